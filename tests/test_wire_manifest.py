"""qstrat.transport.wire_manifest: a round's wire manifest from a plan, what an engine started on a
checkpoint expects, and the refusals of a bad layout or document. Layout, round trip and
check_against on hand-made specs: tests/test_transport.py."""
from __future__ import annotations

import pytest
import torch

from qstrat import RefitDriver
from qstrat.execute.checkpoint import write_checkpoint
from qstrat.errors import WireManifestMismatchError
from qstrat.transport.wire_manifest import (
    DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, VERSION, WireManifest, build_wire_manifest, check_against,
    expected_from_checkpoint, wire_manifest_for_plan)


def test_a_plans_wire_manifest_is_its_outputs_in_wire_order(tiny_model, tiny_hf_config):
    plan = RefitDriver("block-fp8", hf_config=tiny_hf_config).plan(tiny_model.state_dict())
    m = wire_manifest_for_plan(plan, bucket_bytes=1 << 16)
    assert [(s.name, s.dtype, s.shape) for s in m.slots] == [(o.name, o.dtype, o.shape) for o in plan.outputs()]
    assert [s.nbytes for s in m.slots] == [o.nbytes for o in plan.outputs()]
    assert (m.bucket_bytes, m.alignment) == (1 << 16, DEFAULT_ALIGNMENT)
    d = wire_manifest_for_plan(plan)
    assert d.bucket_bytes == DEFAULT_BUCKET_BYTES == 64 << 20 and len(d.buckets) == 1  # the tiny model fits one
    assert d.digest != m.digest


def test_expected_from_checkpoint_reads_the_headers_a_refit_must_match(tiny_model, tiny_hf_config, tmp_path):
    driver = RefitDriver("mxfp8-experts", hf_config=tiny_hf_config)
    plan = driver.plan(tiny_model.state_dict())
    write_checkpoint(driver, tiny_model.state_dict(), tmp_path / "ckpt", shard_bytes=1 << 20)
    expected = expected_from_checkpoint(tmp_path / "ckpt")
    assert expected == {o.name: (o.dtype, tuple(o.shape)) for o in plan.outputs()}
    check_against(wire_manifest_for_plan(plan), expected)  # what it wrote is what it accepts
    with pytest.raises(FileNotFoundError):
        expected_from_checkpoint(tmp_path)


@pytest.mark.parametrize("kwargs,message", [
    ({"alignment": 8}, "alignment 8: must be a power of two >= 16"),
    ({"alignment": 96}, "alignment 96: must be a power of two >= 16"),
    ({"bucket_bytes": 0}, "bucket_bytes 0: must be a positive multiple of the alignment (64)"),
    ({"bucket_bytes": 100, "alignment": 32}, "bucket_bytes 100: must be a positive multiple of the alignment (32)"),
    # a float once passed every check and made a document whose digest the receiver refused as
    # "corrupted or edited in transit"; a bool is not a size either
    ({"bucket_bytes": 16e6}, "bucket_bytes 16000000.0 / alignment 64: give integers (bytes; not float / int)"),
    ({"bucket_bytes": True}, "bucket_bytes True / alignment 64: give integers (bytes; not bool / int)"),
    ({"alignment": 64.0}, "bucket_bytes 67108864 / alignment 64.0: give integers (bytes; not int / float)"),
])
def test_bad_bucket_size_or_alignment_is_refused(kwargs, message):
    with pytest.raises(WireManifestMismatchError) as info:
        build_wire_manifest([("a.weight", "bfloat16", (4, 4))], **kwargs)
    assert str(info.value) == message


def test_numpy_integer_sizes_lay_out_as_plain_ints():
    """NumPy integers are valid sizes: the document holds plain ints (JSON), the same digest."""
    import json

    import numpy as np

    tensors = [("a.weight", "bfloat16", (64, 64))]
    got = build_wire_manifest(tensors, np.int64(1 << 20), np.int32(64))
    assert got.to_dict() == build_wire_manifest(tensors, 1 << 20, 64).to_dict()
    assert type(got.bucket_bytes) is int and json.dumps(got.to_dict())


def test_another_version_or_a_malformed_document_is_refused():
    doc = build_wire_manifest([("a.weight", "float8_e4m3fn", (4, 4))]).to_dict()
    assert doc["version"] == VERSION == 1
    # the version refusal surfaces as itself (it was once wrapped as "malformed wire manifest: ...")
    with pytest.raises(WireManifestMismatchError) as err:
        WireManifest.from_dict({**doc, "version": 2})
    assert str(err.value) == "wire manifest version 2, this qstrat reads version 1"
    with pytest.raises(WireManifestMismatchError) as err:
        WireManifest.from_dict({**doc, "version": "1"})
    assert str(err.value) == "wire manifest version '1', this qstrat reads version 1"
    with pytest.raises(WireManifestMismatchError) as err:
        WireManifest.from_dict({k: v for k, v in doc.items() if k != "version"})
    assert str(err.value) == "malformed wire manifest: KeyError('version')"
    with pytest.raises(WireManifestMismatchError, match=r"^malformed wire manifest: KeyError\('slots'\)$"):
        WireManifest.from_dict({k: v for k, v in doc.items() if k != "slots"})
    with pytest.raises(WireManifestMismatchError, match=r"^malformed wire manifest: ValueError"):
        WireManifest.from_dict({**doc, "bucket_bytes": "many"})


def test_a_zero_byte_tensor_still_has_its_slot():
    m = build_wire_manifest([("empty.weight", "bfloat16", (0, 8)), ("b.weight", "uint8", (3,))], bucket_bytes=128)
    assert [(s.name, s.nbytes, s.bucket, s.offset) for s in m.slots] == [("empty.weight", 0, 0, 0),
                                                                          ("b.weight", 3, 0, 64)]
    assert [b.nbytes for b in m.buckets] == [128] and torch.Size(m.slots[0].shape) == (0, 8)
