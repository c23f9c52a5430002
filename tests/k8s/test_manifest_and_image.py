"""k8s/rayservice.yaml is the chart rendered with its defaults; the image, the chart and the
venv agree on the Ray version; the image installs every package and the bundled policies."""

from __future__ import annotations

import re

import ray

from tests.k8s.chart import CHART, DOCKERFILE, ROOT, render_script


def test_rayservice_yaml_is_current():
    script = render_script()
    assert script.MANIFEST.read_text() == script.render_manifest(), (
        "k8s/rayservice.yaml is stale: run `python scripts/render_k8s.py`")


def test_ray_versions_agree():
    text = DOCKERFILE.read_text()
    (arg,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", text, re.M)
    assert "FROM rayproject/ray:${RAY_VERSION}-py311-gpu" in text
    assert arg == ray.__version__
    chart_values = (CHART / "values.yaml").read_text()
    assert f'rayVersion: "{ray.__version__}"' in chart_values


PYPROJECT = (ROOT / "pyproject.toml").read_text()  # read with re: tomllib is Python 3.11+


def test_chart_app_version_is_the_package_version():
    (version,) = re.findall(r'^version = "([^"]+)"$', PYPROJECT, re.M)
    assert f'appVersion: "{version}"' in (CHART / "Chart.yaml").read_text()


def test_image_copies_every_package_and_the_policies():
    text = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY --chown=ray:users (\S+) ", text, re.M))
    (include,) = re.findall(r"^include = \[(.*)\]$", PYPROJECT, re.M)
    packages = {p.strip(' "*') for p in include.split(",")}
    assert packages == {"engine", "kernels", "serve_app", "deploy"}
    assert packages | {"deploy", "pyproject.toml", "README.md"} <= copied
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not (packages | {"deploy", "README.md", "pyproject.toml"}) & ignored


def test_build_arguments_stay_out_of_the_image_environment():
    """A build argument is in the environment of the RUN steps after it; an ENV that copies one
    puts it in every container's environment and in `docker inspect` (an index URL with a token
    in it, for one)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")  # one line per instruction
    args = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert {"RAY_VERSION", "PIP_EXTRA_INDEX_URL"} <= args
    envs = re.findall(r"^ENV (.*)$", text, re.M)
    assert envs, "the check below would pass on a Dockerfile it cannot read"
    for env in envs:
        copied = sorted(a for a in args if re.search(rf"\${{?{a}\b|\b{a}=", env))
        assert not copied, f"ENV copies the build arguments {copied}: ENV {env}"
