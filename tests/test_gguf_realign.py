"""`python -m models.gguf_realign`: a GGUF file whose expert tensors lie off a 64-byte boundary (XLA:CPU would copy
them instead of mapping them) rewritten with 64-byte alignment, every metadata entry and tensor unchanged; bad
input is a one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from models.gguf import GGUFFile, unaliasable_expert_bytes
from models.gguf_realign import RealignError, realign

Q8 = gguf.GGMLQuantizationType.Q8_0


def misaligned_file(path: Path) -> Path:
    """A small GGUF (Q8_0 experts, an f32 norm, string, int and array metadata) whose data section starts 32 bytes
    off a 64-byte boundary, as released files written with the default alignment of 32 can."""
    rng = np.random.default_rng(0)
    for pad in range(64):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_name("realign-test" + "x" * pad)
        w.add_uint32("llama.expert_count", 4)
        w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        for kind in ("gate", "up", "down"):
            w.add_tensor(f"blk.0.ffn_{kind}_exps.weight",
                         gguf.quants.quantize(rng.standard_normal((4, 64, 64)).astype(np.float32), Q8), raw_dtype=Q8)
        w.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal(64).astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if gguf.GGUFReader(path).data_offset % 64 == 32:
            return path
    raise AssertionError("no name length put the data section 32 bytes off")


def test_realigned_file_maps_every_expert_and_keeps_every_byte(tmp_path: Path) -> None:
    src = misaligned_file(tmp_path / "in.gguf")
    assert unaliasable_expert_bytes(GGUFFile(src)) == 3 * 4 * 64 * 68  # every expert tensor would be copied
    done = realign(src, tmp_path / "out.gguf")
    assert done["alignment_before"] == 32 and done["alignment"] == 64 and done["data_offset"] % 64 == 0
    assert unaliasable_expert_bytes(GGUFFile(tmp_path / "out.gguf")) == 0
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "out.gguf")
    assert b.alignment == 64 and b.fields["general.alignment"].contents() == 64
    assert [k for k in b.fields if k != "general.alignment"] == list(a.fields)
    for key, field in a.fields.items():
        if not key.startswith("GGUF.kv_count"):
            assert b.fields[key].contents() == field.contents(), key
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert (x.tensor_type, x.shape.tolist()) == (y.tensor_type, y.shape.tolist())
        np.testing.assert_array_equal(np.asarray(y.data).view(np.uint8), np.asarray(x.data).view(np.uint8))
    # a file that already says 64 keeps one alignment entry, with that value
    again = realign(tmp_path / "out.gguf", tmp_path / "again.gguf")
    assert again["alignment_before"] == 64
    assert list(gguf.GGUFReader(tmp_path / "again.gguf").fields) == list(b.fields)


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    src = misaligned_file(tmp_path / "in.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:-100])
    for bad, words in ((cut, "truncated"), (tmp_path / "none.gguf", "not found"), (src, "another file")):
        dst = src if bad == src else tmp_path / "out.gguf"
        with pytest.raises(RealignError) as err:
            realign(bad, dst)
        assert words in str(err.value) and str(bad) in str(err.value) and "\n" not in str(err.value)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 8)
    proc = subprocess.run([sys.executable, "-m", "models.gguf_realign", str(junk), str(tmp_path / "o.gguf")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith(f"gguf_realign: {junk}: truncated or not a GGUF file")
    assert not (tmp_path / "o.gguf").exists()


def test_llama_quantizer_output_gets_the_alignment_its_data_was_laid_out_at(tmp_path: Path) -> None:
    """llama.cpp's quantizer copies a source's `general.alignment = 64` but lays its file out at 32
    (engine/bench/peers/llama_quantize.py): such a file reads 32 bytes past every tensor until repaired."""
    from engine.bench.peers.llama_quantize import repair_alignment

    rng = np.random.default_rng(1)
    weights = gguf.quants.quantize(rng.standard_normal((4, 64, 64)).astype(np.float32), Q8)
    path = tmp_path / "quantized.gguf"
    for pad in range(64):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_custom_alignment(32)
        w.add_name("q" * pad)
        w.add_tensor("blk.0.ffn_up_exps.weight", weights, raw_dtype=Q8)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if gguf.GGUFReader(path).data_offset % 64 == 32:
            break
    field = gguf.GGUFReader(path).fields["general.alignment"]
    with open(path, "r+b") as f:  # what the quantizer writes: the source's 64 over a layout at 32
        f.seek(int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1]))
        f.write(np.uint32(64).tobytes())
    with pytest.raises(ValueError):
        gguf.GGUFReader(path)

    assert repair_alignment(path) == 64
    assert repair_alignment(path) is None  # consistent now: left alone
    np.testing.assert_array_equal(np.asarray(gguf.GGUFReader(path).tensors[0].data), weights)
