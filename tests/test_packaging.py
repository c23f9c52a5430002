"""The wheel: the non-Python files the installed package reads beside its modules, and the
dependency bounds the code needs.

The wheel is built once, from a copy of the checkout (so no stale ``build/`` leaks into it),
with ``pip wheel --no-deps --no-build-isolation``. ``scripts/check_wheel.sh`` (run by CI) goes
further: it installs the wheel in a fresh venv and starts the app from it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kernels import cpu_kernels
from serve_app.autoscaling import config as autoscaling_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "serve_app", "deploy")
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", "out")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_COPIED)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp / "dist"), str(tmp / "src")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    (path,) = (tmp / "dist").glob("pagedserve-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def in_checkout(path: Path) -> str:
    """``path``'s name inside the wheel: packages sit at the wheel's root as in the checkout."""
    return path.relative_to(ROOT).as_posix()


def test_bundled_autoscaling_policies_are_where_the_code_looks(wheel):
    policies = sorted((ROOT / "deploy" / "autoscaling").glob("*.yaml"))
    assert [p.stem for p in policies] == ["latency_first", "scale_to_zero", "throughput_first"]
    assert autoscaling_config.POLICY_DIR == ROOT / "deploy" / "autoscaling"
    missing = {in_checkout(p) for p in policies} - set(wheel.namelist())
    assert not missing, f"not in the wheel: {sorted(missing)}"


def test_cpu_kernel_sources_are_in_the_wheel(wheel):
    sources = sorted((ROOT / "kernels" / "csrc").iterdir())
    assert set(cpu_kernels.SOURCES + cpu_kernels.HEADERS) <= set(sources)
    missing = {in_checkout(p) for p in sources} - set(wheel.namelist())
    assert not missing, f"not in the wheel: {sorted(missing)}"


def test_grafana_dashboard_json_is_in_the_wheel(wheel):
    assert "deploy/grafana/pagedserve.json" in wheel.namelist()


def test_the_commands_are_in_the_wheel(wheel):
    # pagedserve-haproxy: the Helm chart's pods name it in RAY_SERVE_HAPROXY_BINARY_PATH
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert wheel.read(entry_points).decode().split() == [
        "[console_scripts]", "pagedserve", "=", "serve_app.cli:main",
        "pagedserve-haproxy", "=", "serve_app.cluster.haproxy_launcher:main"]


def test_every_package_and_nothing_else_is_in_the_wheel(wheel):
    inits = {in_checkout(p) for name in PACKAGES for p in (ROOT / name).rglob("__init__.py")}
    names = set(wheel.namelist())
    assert inits <= names, f"packages missing from the wheel: {sorted(inits - names)}"
    tops = {n.split("/")[0] for n in names if not n.startswith("pagedserve-")}
    assert tops == set(PACKAGES)


def requirements(wheel: zipfile.ZipFile) -> dict[str, list[Requirement]]:
    """``Requires-Dist`` of the wheel by extra ("" for the base dependencies)."""
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    by_extra: dict[str, list[Requirement]] = {}
    for line in Parser().parsestr(wheel.read(meta).decode()).get_all("Requires-Dist"):
        req = Requirement(line)
        extra = next((e for e in ("kernels", "test", "grafana", "bench", "dev")
                      if req.marker and req.marker.evaluate({"extra": e})), "")
        by_extra.setdefault(extra, []).append(req)
    return by_extra


def spec(reqs: list[Requirement], name: str) -> Requirement:
    (req,) = [r for r in reqs if r.name == name]
    return req


def test_ray_bound_is_the_release_the_code_is_written_for(wheel):
    ray = spec(requirements(wheel)[""], "ray")
    assert ray.extras == {"serve"}
    assert [v for v in ("2.50.0", "2.59.0", "2.60.0", "2.61.0") if ray.specifier.contains(v)] \
        == ["2.60.0"]


def test_triton_bound_admits_only_releases_the_kernel_tests_pass_on(wheel):
    by_extra = requirements(wheel)
    for extra in ("kernels", "test"):
        triton = spec(by_extra[extra], "triton").specifier
        assert not triton.contains("3.6.0"), extra  # its interpreter fails under numpy 2.4
        assert triton.contains("3.7.0") and triton.contains("3.9.0"), extra


def test_grafana_extra_installs_what_python_m_deploy_grafana_imports(wheel):
    by_extra = requirements(wheel)
    grafana = {r.name for r in by_extra["grafana"]}
    assert grafana == {"grafana-foundation-sdk", "grafana-client"}
    assert "pagedserve" in {r.name for r in by_extra["test"]}  # test = pagedserve[grafana] + ...
