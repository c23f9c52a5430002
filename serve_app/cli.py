"""``pagedserve``: the command line, vLLM's way.

``pagedserve serve MODEL [flags]`` serves the OpenAI API on ``--host``:``--port``: the same
application as ``serve run serve_app:build_app model=MODEL ...`` (``build_app``, then Ray Serve
in the foreground; Ctrl-C shuts it down). ``pagedserve generate MODEL --prompt TEXT`` runs the
offline ``engine.LLM`` and prints each completion's text. Without MODEL both use the small
random-weight default model.

The flags are the settings' own fields, named as vLLM names its flags: every engine setting
(``--dtype``, ``--max-model-len``, ``--tensor-parallel-size``, ...) and, for ``serve``, every
field of ``AppConfig`` (``--served-model-name``, ``--api-key``, ``--num-workers``, ...), with
the field's description as help; booleans take ``--x`` / ``--no-x``. Only the flags given reach
the config, so every default stays the config's own. vLLM's other names for some of them:
``-tp``, ``-q``, ``--data-parallel-size`` / ``-dp`` (Worker replicas), ``--kv-cache-memory``,
and ``--enable-auto-tool-choice`` (which needs ``--tool-call-parser``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from engine import EngineConfig
from serve_app.config import AppConfig

if TYPE_CHECKING:
    from engine import LLM

ALIASES = {"tensor_parallel_size": ["-tp"], "quantization": ["-q"],
           "num_workers": ["--data-parallel-size", "-dp"],
           "kv_cache_memory_bytes": ["--kv-cache-memory"]}
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000  # Serve's defaults: this machine only


def engine_fields() -> dict[str, FieldInfo]:
    """The engine's settings by flat name (those ``EngineConfig.from_kwargs`` takes)."""
    fields: dict[str, FieldInfo] = {}
    for section in EngineConfig.model_fields.values():
        if isinstance(section.annotation, type):
            fields.update(section.annotation.model_fields)
    return fields


def app_fields() -> dict[str, FieldInfo]:
    """``AppConfig``'s serving settings (its ``engine`` section is ``engine_fields``)."""
    return {k: f for k, f in AppConfig.model_fields.items() if k != "engine"}


def _flag_kwargs(annotation: Any) -> dict[str, Any]:
    """How argparse reads a field of this type; pydantic checks the value afterwards."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        annotation = args[0]  # X | None: X
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float):
        return {"type": annotation, "metavar": annotation.__name__.upper()}
    if get_origin(annotation) is Literal:
        return {"choices": [str(v) for v in get_args(annotation)]}
    return {"type": str, "metavar": "STR" if annotation in (str, SecretStr) else "VALUE"}


def add_field_flags(parser: argparse.ArgumentParser, title: str,
                    fields: dict[str, FieldInfo]) -> None:
    """One ``--name`` flag per field (``model``: the positional MODEL instead)."""
    group = parser.add_argument_group(title)
    for name, field in fields.items():
        if name == "model":
            continue
        flags = ["--" + name.replace("_", "-"), *ALIASES.get(name, [])]
        text = (field.description or "").replace("%", "%%")
        group.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=text,
                           **_flag_kwargs(field.annotation))


def build_parser() -> argparse.ArgumentParser:
    from serve_app.router.endpoints import pagedserve_version

    parser = argparse.ArgumentParser(prog="pagedserve", description="OpenAI-compatible LLM "
                                     "serving on Ray Serve, and offline generation.")
    parser.add_argument("--version", action="version", version=pagedserve_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve the OpenAI API (Ray Serve, foreground)",
                                description="Serve MODEL over HTTP until Ctrl-C.",
                                usage="%(prog)s [MODEL] [--flag VALUE ...]")
    gen = commands.add_parser("generate", help="complete prompts offline and print the text",
                              usage="%(prog)s [MODEL] --prompt TEXT [--flag VALUE ...]",
                              description="Complete each --prompt with the offline engine and "
                              "print the generated text, one completion per prompt.")
    for sub in (serve, gen):
        sub.set_defaults(parser=sub)  # usage errors show the command's usage
        sub.add_argument("model", nargs="?", default=None, metavar="MODEL",
                         help="checkpoint folder or Hugging Face Hub id (owner/name); "
                         "omitted: the small random-weight default model")
    serve.add_argument("--host", default=DEFAULT_HOST, help="address the HTTP server binds "
                       f"(default {DEFAULT_HOST}; 0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's switch for tool_choice 'auto'; needs --tool-call-parser")
    add_field_flags(serve, "serving (AppConfig)", app_fields())
    add_field_flags(serve, "engine (EngineConfig)", engine_fields())
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    add_field_flags(gen, "engine (EngineConfig)", engine_fields())
    return parser


def _parse(command: str, argv: Sequence[str]) -> tuple[argparse.Namespace,
                                                    argparse.ArgumentParser]:
    """The command's arguments, and its parser (whose usage its errors show)."""
    args, unknown = build_parser().parse_known_args([command, *argv])
    parser: argparse.ArgumentParser = args.parser
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, parser


def _given(args: argparse.Namespace, fields: dict[str, FieldInfo]) -> dict[str, Any]:
    given = {k: v for k, v in vars(args).items() if k in fields}
    if args.model is not None:
        given["model"] = args.model
    return given


def check_model(parser: argparse.ArgumentParser, model: str | None) -> None:
    """A MODEL that is neither a folder nor reads as a Hub id is a usage error, before any
    start-up work."""
    from engine import looks_like_repo_id

    if model is not None and not Path(model).expanduser().is_dir() \
            and not looks_like_repo_id(model):
        parser.error(f"model folder {model!r} does not exist (nor is it a Hub id owner/name)")


def serve_settings(argv: Sequence[str]) -> tuple[AppConfig, str, int]:
    """``pagedserve serve`` arguments -> (the app's config, host, port); exits on a usage
    error (argparse's one line, or a setting pydantic refuses)."""
    args, parser = _parse("serve", argv)
    check_model(parser, args.model)
    if args.enable_auto_tool_choice and "tool_call_parser" not in vars(args):
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    settings = _given(args, {**app_fields(), **engine_fields()})
    try:
        return AppConfig.model_validate(settings), args.host, args.port
    except ValidationError as exc:
        parser.error(_one_line(exc))


def _one_line(exc: ValidationError) -> str:
    """The first error, as ``--flag-name: message`` when it names a flag's field."""
    err = exc.errors()[0]
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[-1] in {**app_fields(), **engine_fields()}:
        return f"--{loc[-1].replace('_', '-')}: {message}"
    return message


def serve(cfg: AppConfig, host: str, port: int) -> None:
    """Run the app in the foreground as ``serve run`` does (a local Ray cluster unless
    RAY_ADDRESS names one) until Ctrl-C, then shut Serve down."""
    import ray
    from ray import serve as ray_serve
    from ray.serve._private.constants import SERVE_NAMESPACE

    from serve_app.app import build_app

    app = build_app(cfg)  # before Ray starts: it sets the cluster's environment
    # Ctrl-C and a supervisor's SIGTERM stop it, also when it was started in the background
    # (a non-interactive shell starts background jobs with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        ray.init(namespace=SERVE_NAMESPACE)
        ray_serve.start(http_options={"host": host, "port": port})
        ray_serve.run(app, blocking=True, name="default", route_prefix="/")
    except KeyboardInterrupt:
        print("pagedserve: shutting down", file=sys.stderr)
    finally:
        if ray.is_initialized():
            ray_serve.shutdown()  # type: ignore[no-untyped-call]  # Ray 2.60: unannotated
            ray.shutdown()


def generate(argv: Sequence[str]) -> list[str]:
    """``pagedserve generate`` arguments -> each prompt's completion text."""
    from engine import SamplingParams

    args, parser = _parse("generate", argv)
    check_model(parser, args.model)
    llm = _llm(parser, _given(args, engine_fields()))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p)
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]
    except ValueError as exc:
        parser.error(str(exc))
    finally:
        llm.shutdown()


def _llm(parser: argparse.ArgumentParser, settings: dict[str, Any]) -> LLM:
    from engine import LLM

    try:
        return LLM(**settings)
    except ValidationError as exc:
        parser.error(_one_line(exc))
    except ValueError as exc:  # the checkpoint: its files, its config
        parser.error(str(exc).splitlines()[0])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        for text in generate(argv[1:]):
            print(text)
        return 0
    if argv[:1] == ["serve"]:
        serve(*serve_settings(argv[1:]))
        return 0
    build_parser().parse_args(argv)  # --help, --version, or argparse's error
    return 2


if __name__ == "__main__":
    sys.exit(main())
