"""loopbench: reproducible, auditable A/B evidence for looped-language-model inference.

The project's packages live at the top of the repository (``runtime/``, ``harness/``, ``kernels/``,
``audit/``) but are imported as ``loopbench.runtime``, ``loopbench.harness``, ``loopbench.kernels`` and
``loopbench.audit`` so that they can
never clash with unrelated PyPI packages of the same name (PyPI already has a ``kernels``).

Installed (``pip install .``), setuptools maps those folders under this package.  In a plain source
checkout (``PYTHONPATH=<repo>``, as on the GPU host where nothing may be installed), this file adds the
repository root to the package path so that the same import names resolve to the folders in place.
"""
from pathlib import Path as _Path

__version__ = "0.1.0"

_root = _Path(__file__).resolve().parent.parent
if (_root / "harness" / "__init__.py").is_file() and str(_root) not in __path__:
    __path__.append(str(_root))
