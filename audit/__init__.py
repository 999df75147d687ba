"""loopbench's independent auditor: ``python -m loopbench.audit BUNDLE_DIR``.

Reads only a bundle and imports nothing from ``loopbench.harness`` (tests/audit/test_independence.py proves it);
see :mod:`loopbench.audit.auditor` for what it verifies, and audit/FORMAT.md for the bundle format.
"""
