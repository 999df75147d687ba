"""environment.json's GPUs are the cards the records say they ran on: a forged card name or UUID in the
environment (an H100 run presented as an H200 one), with the manifest rewritten, is named."""
import json
import shutil

import pytest

from tests.audit.tamper import REPO, edit_json, failed, republish, rewrite_manifest

GPU_BUNDLE = "2026-12-07-ouro-1.4b-2cd50364"   # one pinned CUDA device, NVML present


@pytest.fixture
def gpu_bundle(tmp_path):
    copy = tmp_path / GPU_BUNDLE
    shutil.copytree(REPO / "results" / GPU_BUNDLE, copy)
    (copy / "audit.json").unlink(missing_ok=True)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("name", "NVIDIA H200"), ("uuid", "GPU-00000000-0000-0000-0000-000000000000")])
def test_environment_gpu_other_than_the_records_card_is_named(gpu_bundle, field, value):
    record = json.loads(next((gpu_bundle / "raw" / "gpu0").glob("00000-*.json")).read_text())
    edit_json(gpu_bundle / "environment.json", lambda env: env["gpus"][0].update({field: value}))
    rewrite_manifest(gpu_bundle)
    text = failed(gpu_bundle)
    assert (f"environment.json: gpus entry of index 0 has {field} {value!r}, where record gpu0 seq 0 ran on "
            f"{record['device'][field]!r}") in text, text


def test_environment_torch_other_than_the_reference_childs_is_named(bundle):
    """A CPU run presented as one on the GPU host's torch: report.md's header agrees with the forged environment,
    the torch each frozen reference's meta records does not."""
    ran = json.loads((bundle / "references" / "B2C3.meta.json").read_text())["torch"]
    edit_json(bundle / "environment.json", lambda env: (env["torch"].update(version="2.11.0+cu130"),
                                                        env["packages"].update(torch="2.11.0")))
    republish(bundle)   # report.md's header now names the forged torch
    assert (f"environment.json: torch.version is '2.11.0+cu130', where references/B2C3.meta.json records that the "
            f"reference child ran torch {ran!r}") in failed(bundle)


def test_package_torch_other_than_the_torch_version_is_named(bundle):
    version = json.loads((bundle / "environment.json").read_text())["torch"]["version"]
    edit_json(bundle / "environment.json", lambda env: env["packages"].update(torch="2.11.0"))
    republish(bundle)
    assert f"environment.json: packages.torch is '2.11.0', torch.version {version!r}" in failed(bundle)
