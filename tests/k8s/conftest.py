"""Fixtures for the chart tests: Helm's SDK (required) and the KubeRay CRD (skipped if absent)."""

from __future__ import annotations

import pytest

from tests.k8s.chart import RAYSERVICE_CRD, rayservice_schema


@pytest.fixture(scope="session", autouse=True)
def _helm_sdk():
    try:
        import helm_python  # noqa: F401
    except ImportError:
        pytest.fail("tests/k8s render the chart with Helm's Go SDK: pip install helm-python-sdk "
                    "(in pyproject's test extra)", pytrace=False)


@pytest.fixture(scope="session")
def crd_validator():
    """A validator for RayService objects, from the shared KubeRay CRD."""
    if not RAYSERVICE_CRD.is_file():
        pytest.skip(f"KubeRay CRD not found at {RAYSERVICE_CRD} (CI puts the shared folder "
                    "beside the repository as ../shared)")
    import jsonschema

    schema = rayservice_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)
