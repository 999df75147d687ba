"""A bundle that claims format version 1 (audited by its laxer rules) but carries version-2 content is named."""
import json

from tests.audit.tamper import failed, rewrite_manifest


def _claim_version(bundle, **fields) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest.pop("format_version")
    (bundle / "manifest.json").write_text(json.dumps({**manifest, **fields}))
    rewrite_manifest(bundle)   # keeps the claimed version fields


def test_version_1_claim_with_point_request_lists_is_named(bundle):
    _claim_version(bundle, layout_version=1)
    assert "plan: point B2C3 lists its requests, which format version 1 does not" in failed(bundle)


def test_version_1_claim_with_format_version_is_named(bundle):
    _claim_version(bundle, format_version=1)
    assert "layout: manifest.json of format version 1 has format_version" in failed(bundle)
