"""The public API resolves from ``pipeline`` and importing the package stays light."""

from __future__ import annotations

import subprocess
import sys

import pipeline


def test_every_exported_name_resolves():
    assert sorted(pipeline.__all__) == sorted(pipeline._EXPORTS)
    for name in pipeline.__all__:
        assert getattr(pipeline, name) is not None, name


def test_import_pipeline_does_not_load_sqlalchemy_or_opentelemetry():
    code = (
        "import sys, pipeline; "
        "print(sorted(m for m in ('sqlalchemy', 'opentelemetry') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
