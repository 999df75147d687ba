"""Checks of the bundle as a set of files: the manifest (sha256 and size of every file, the format
version), the files the contract requires, and no file the contract does not define."""
from __future__ import annotations

import os
from pathlib import Path

from . import contract, derive
from .context import Audit
from .values import sha256_file


def check_manifest(ctx: Audit) -> None:
    """Every file listed is there unchanged; every file there (dotfiles included) is listed."""
    manifest = ctx.read_json("manifest.json")
    if manifest is None:
        return
    check_format_version(ctx, manifest)
    closed = ctx.version >= contract.CLOSED_SINCE
    if closed:
        problem = contract.fields_problem(manifest, contract.DOCS["manifest"]["fields"], "manifest.json: ",
                                          closed=True)
        if problem is not None:
            ctx.fail("manifest", problem)
    listed = manifest["files"]
    for rel, entry in sorted(listed.items()):
        if Path(rel).is_absolute() or ".." in Path(rel).parts or rel in contract.UNMANIFESTED:
            ctx.fail("manifest", f"lists {rel!r}, which cannot be a file of the bundle")
            continue
        p = ctx.bundle / rel
        problem = contract.fields_problem(entry, contract.DOCS["manifest"]["entry_fields"], f"{rel}: ",
                                          closed=closed) \
            if isinstance(entry, dict) else f"{rel}: {entry!r}"
        if problem is not None:
            ctx.fail("manifest", f"lists {problem}")
            continue
        if not p.is_file():
            ctx.fail("manifest", f"{rel} is listed but missing")
            continue
        if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            ctx.fail("manifest", f"{rel} changed: sha256 {sha256_file(p)} does not match the manifest's "
                                 f"{entry['sha256']}")
        ctx.count("files")
    for p in sorted(ctx.bundle.rglob("*")):
        rel = p.relative_to(ctx.bundle).as_posix()
        if p.is_file() and rel not in contract.UNMANIFESTED and rel not in listed:
            ctx.fail("manifest", f"{rel} is in the bundle but not in the manifest")


def check_format_version(ctx: Audit, manifest: dict) -> None:
    """The manifest's format version is one this auditor audits (``supported_versions``); the bundle is
    then audited by that version's rules (the contract's ``versions``)."""
    version = contract.manifest_version(manifest)
    if not contract.is_kind(version, "int") or version not in contract.SUPPORTED:
        ctx.fail("layout", f"manifest.json records bundle format version {version!r}; this auditor audits "
                           f"versions {list(contract.SUPPORTED)} ({contract.WHERE})")
        return
    ctx.version = version
    field = contract.DOCS["manifest"]["version_field"][str(version)]
    other = [k for k in contract.DOCS["manifest"]["version_field"].values() if k != field and k in manifest]
    if other:
        ctx.fail("layout", f"manifest.json of format version {version} has {other[0]}")


def sessions_ran(children: list, records: list[dict]) -> set[str]:
    """The session ids that children.json or a raw record shows ran (a resume's are ``<device>.r<k>``)."""
    ran = {derive.child_session(c) for c in children if isinstance(c, dict) and isinstance(c.get("name"), str)}
    return ran | {derive.record_session(r) for r in records}


def check_no_links(ctx: Audit) -> None:
    """No symbolic link in the bundle, to a file or a folder: the writer writes every file itself, and a link's target
    lies outside what the manifest and a copy of the bundle hold (the manifest hashes what it points to today)."""
    for p in sorted(ctx.bundle.rglob("*")):
        if p.is_symlink():
            ctx.fail("files", f"{p.relative_to(ctx.bundle).as_posix()} is a symbolic link (to {os.readlink(p)}), "
                              "not a file of the bundle")


def check_required_files(ctx: Audit, plan: dict, children: list, records: list[dict]) -> None:
    """The contract's required files: what every bundle holds, and what each point and session adds."""
    for rel in contract.layout_required(plan, sessions_ran(children, records)):
        if not (ctx.bundle / rel).is_file():
            ctx.fail("files", f"required file {rel} is missing")
        ctx.count("required_files")


def check_layout(ctx: Audit, plan: dict, sessions: set[str]) -> None:
    """No file outside the contract, even one the manifest lists: a stray file can carry claims (a table,
    a report) that no check reads."""
    for rel in contract.layout_strays(ctx.bundle, plan, sessions, ctx.version):
        ctx.fail("layout", f"{rel} is not a file of the bundle layout ({contract.WHERE})")
    ctx.count("layout_files", sum(1 for p in ctx.bundle.rglob("*") if p.is_file()))
