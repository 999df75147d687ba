"""``python -m loopbench.audit BUNDLE_DIR``: audit one evidence bundle, write ``audit.json``, exit 0/1/3.

Exit status: 0 the bundle is complete and every claim in it re-derives; 1 discrepancies (each printed,
naming the file, arm, request and position or number that differs); 3 consistent but incomplete (a
partial run that honestly publishes no verdict); 2 usage error; 130 interrupted (Ctrl-C), nothing written.
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    try:    # the auditor's imports (pandas, scipy) inside: Ctrl-C there too is one line, not a traceback
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("audit interrupted: no verdict written", file=sys.stderr)
        return 130   # 128 + SIGINT, as a shell reports it; not an audit status


def _main(argv: list[str]) -> int:
    from loopbench.audit.auditor import EXIT_CODES, audit, write_verdict

    if len(argv) != 1:
        print("usage: python -m loopbench.audit BUNDLE_DIR", file=sys.stderr)
        return EXIT_CODES["usage"]
    if not Path(argv[0]).is_dir():
        print(f"no bundle directory at {argv[0]!r}\nusage: python -m loopbench.audit BUNDLE_DIR", file=sys.stderr)
        return EXIT_CODES["usage"]
    bundle = Path(argv[0])
    if not (bundle / "plan.json").is_file():     # any folder is not a bundle: write no audit.json into it
        print(f"{argv[0]!r} is not a bundle (no plan.json)\nusage: python -m loopbench.audit BUNDLE_DIR", file=sys.stderr)
        return EXIT_CODES["usage"]
    verdict = audit(bundle)
    path = write_verdict(bundle, verdict)
    checked = ", ".join(f"{k} {v:,}" for k, v in sorted(verdict["checked"].items()))
    print(f"audit {verdict['status'].upper()}: {bundle} ({checked})")
    for d in verdict["discrepancies"]:
        print(f"  - {d}")
    print(f"verdict written to {path}")
    return EXIT_CODES[verdict["status"]]


if __name__ == "__main__":
    sys.exit(main())
