"""loopbench's independent auditor: ``python -m loopbench.audit BUNDLE_DIR``.

Reads only a bundle and imports nothing from ``loopbench.harness`` (tests/test_audit.py proves it);
see :mod:`loopbench.audit.auditor` for what it verifies.
"""
