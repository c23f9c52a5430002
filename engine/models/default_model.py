"""The default model: a small random-weight Llama with a real byte-level BPE tokenizer and a chat
template, built offline in seconds on first use (``python -m engine.models.default_model DIR``).

Its text is gibberish, but everything about loading, batching and serving it is real. The build
is deterministic: the same files on every machine with the same library versions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine.envs import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_NAME = "pagedserve-default"
_VERSION = "v1"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the river runs quietly to the sea.
A paged cache keeps the keys and values of every sequence in fixed blocks of memory.
When a request arrives, the scheduler admits it if the cache has room for its prompt.
Continuous batching lets new requests join the batch at every step of the decoder.
Tokens are generated one at a time; each new token attends to all the tokens before it.
Hello, my name is Ada. I like to read books about mountains, rivers, cities and stars.
What is the capital of France? Paris is the capital of France, and Rome is in Italy.
Please write a short poem about the ocean, the wind, the moon and the morning light.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096
She said: "It's a beautiful day!" and we walked through the park until the evening.
Engineers measure throughput in tokens per second and latency in milliseconds.
Café, naïve, jalapeño, über, façade: words that carry accents across languages.
日本語のテキスト、中文文本、한국어 텍스트 and emoji 🙂🚀 are split into bytes.
"""


def default_model_path() -> Path:
    """The default model's folder, built on first use."""
    path = cache_dir() / f"default-model-{_VERSION}"
    if not (path / "config.json").is_file():
        build_default_model(path)
    return path


def _train_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = _CORPUS.splitlines()
    tok.train_from_iterator([f"{a} {b}" for a in lines for b in lines], trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated __init__
        tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=CHAT_TEMPLATE)


def build_default_model(path: str | Path) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer) to ``path`` atomically."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".default-model-", dir=path.parent))
    tmp.chmod(0o755)
    try:
        tokenizer = _train_tokenizer()
        vocab = -(-len(tokenizer) // 64) * 64
        eos = tokenizer.convert_tokens_to_ids(["<|eos|>", "<|im_end|>"])
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        # transformers' decorator on PreTrainedModel.to hides its signature from mypy
        model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        gen = GenerationConfig(  # type: ignore[no-untyped-call]  # unannotated __init__
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
        gen.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process built it first
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", nargs="?", help="where to write it (default: the cache folder)")
    args = parser.parse_args()
    print(build_default_model(args.dir) if args.dir else default_model_path())


if __name__ == "__main__":
    main()
