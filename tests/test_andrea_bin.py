"""The ANDREA raw ``.bin`` codec (docs/FORMAT.md): bytes, validation, exact resume."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import rchar

from ripresa.errors import BadInput, IntegrityError, RipresaError, SaveFailed, SchemaError
from ripresa.formats import andrea_bin as ab
from ripresa.formats.andrea_bin import (
    BIN_LACKS,
    MAX_PARAMS,
    bin_name,
    check_n_params,
    companion_path,
    describe_missing,
    parse_bin_name,
    read_bin,
    read_header,
    save_bin,
    write_bin,
)
from ripresa.formats.bin_state import adamw_step, flatten_model_and_adamw, load_into_model_and_adamw
from ripresa.io.fsio import StagedFile, read_sidecar, sidecar_path

FIXTURES = Path(__file__).parent / "fixtures" / "andrea"

# The golden state: step 7, three parameters. Values are exact in float32.
G_STEP = 7
G_W = [1.0, 2.0, 3.0]
G_M = [0.5, -0.25, 0.125]
G_V = [0.0009765625, 0.25, 4.0]
G_BYTES = struct.pack("<ii3f3f3f", G_STEP, 3, *G_W, *G_M, *G_V)
G_HEX = (
    "07000000" "03000000"  # step=7, n=3 (int32 LE)
    "0000803f" "00000040" "00004040"  # weights 1, 2, 3
    "0000003f" "000080be" "0000003e"  # m 0.5, -0.25, 0.125
    "0000803a" "0000803e" "00008040"  # v 2**-10, 0.25, 4
)


def f32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.float32)


def write_raw(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def header_bytes(step: int, n: int) -> bytes:
    return struct.pack("<ii", step, n)


def valid_file(tmp_path: Path, n: int = 4, step: int = 3, name: str | None = None) -> tuple[Path, bytes]:
    rng = np.random.default_rng(n)
    body = rng.standard_normal(3 * n).astype("<f4").tobytes()
    data = header_bytes(step, n) + body
    return write_raw(tmp_path / (name or bin_name(step)), data), data


# ---- names ---------------------------------------------------------------------


def test_bin_names_round_trip_and_reject_non_canonical():
    assert bin_name(0) == "step_000000.bin"
    assert bin_name(7) == "step_000007.bin"
    assert bin_name(999_999) == "step_999999.bin"
    assert bin_name(1_234_567) == "step_1234567.bin"  # wider when needed
    for s in (0, 7, 100, 999_999, 1_000_000, MAX_PARAMS):
        assert parse_bin_name(bin_name(s)) == s
    assert parse_bin_name(Path("/runs/x") / "step_000100.bin") == 100
    for bad in (
        "step_7.bin",
        "step_00007.bin",
        "step_0000007.bin",  # non-canonical padding
        "step_000007.bin.sha256",
        "step_000007.json",
        "step_00000a.bin",
        "step_-00001.bin",
        "step_\u0660\u0660\u0660\u0660\u0660\u0667.bin",  # Arabic-Indic digits
        "xstep_000007.bin",
        f"step_{2**31}.bin",  # beyond int32
    ):
        assert parse_bin_name(bad) is None, bad
    for bad in (-1, True, 2**31, 1.0):
        with pytest.raises(BadInput):
            bin_name(bad)  # type: ignore[arg-type]
    assert companion_path("/r/step_000007.bin") == Path("/r/step_000007.json")


# ---- golden bytes ----------------------------------------------------------------


def test_golden_bytes_written_exactly(tmp_path):
    assert G_BYTES.hex() == G_HEX  # the literal and the struct layout agree
    assert G_BYTES == (FIXTURES / "step_000007.bin").read_bytes()
    path = tmp_path / bin_name(G_STEP)
    digest = save_bin(path, G_STEP, f32(G_W), f32(G_M), f32(G_V))
    assert path.read_bytes() == G_BYTES
    assert digest.size == len(G_BYTES) == 8 + 12 * 3
    # the same bytes from torch tensors and from per-parameter chunk lists
    path2 = tmp_path / "t" / bin_name(G_STEP)
    path2.parent.mkdir()
    save_bin(
        path2,
        G_STEP,
        [torch.tensor(G_W[:1]), torch.tensor(G_W[1:])],
        torch.tensor(G_M),
        [f32(G_V[:2]), torch.tensor(G_V[2:])],
    )
    assert path2.read_bytes() == G_BYTES
    # no temporaries left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, sidecar_path(path).name, "t"]
    )


def test_golden_read_back(tmp_path):
    for path in (FIXTURES / "step_000007.bin", write_raw(tmp_path / "any_name.bin", G_BYTES)):
        h = read_header(path)
        assert (h.step, h.n_params, h.file_size) == (7, 3, 44)
        assert (h.offset("weights"), h.offset("m"), h.offset("v")) == (8, 20, 32)
        c = read_bin(path, expected_n=3, check_finite=True)
        assert (c.step, c.n_params) == (7, 3)
        assert c.weights.dtype == np.dtype("<f4")
        np.testing.assert_array_equal(c.weights, f32(G_W))
        np.testing.assert_array_equal(c.m, f32(G_M))
        np.testing.assert_array_equal(c.v, f32(G_V))
        cm = read_bin(path, mmap=True)
        np.testing.assert_array_equal(cm.v, f32(G_V))
    assert path.read_bytes() == G_BYTES


# ---- size and sidecar ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 1000, 70_001])
def test_size_is_8_plus_12n(tmp_path, n):
    rng = np.random.default_rng(n)
    w, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    path = tmp_path / bin_name(n)
    digest = save_bin(path, n, w, m, v)
    assert path.stat().st_size == digest.size == 8 + 12 * n
    c = read_bin(path, expected_n=n, expected_sha256=digest.sha256)
    assert c.digest == digest
    for a, b in ((c.weights, w), (c.m, m), (c.v, v)):
        np.testing.assert_array_equal(a, b)


def test_sidecar_passes_real_sha256sum_and_detects_damage(tmp_path):
    exe = shutil.which("sha256sum")
    if exe is None:
        pytest.skip("sha256sum not installed")
    path = tmp_path / bin_name(42)
    save_bin(path, 42, f32([1, 2]), f32([3, 4]), f32([5, 6]))
    side = sidecar_path(path)
    assert side.name == "step_000042.bin.sha256"
    ok = subprocess.run([exe, "-c", side.name], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "step_000042.bin: OK" in ok.stdout
    c = read_bin(path, expected_sha256=read_sidecar(path))
    assert c.digest is not None and c.digest.size == 8 + 24
    # flip one bit of v: sha256sum and read_bin both refuse it
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    bad = subprocess.run([exe, "-c", side.name], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0
    with pytest.raises(IntegrityError) as ei:
        read_bin(path, expected_sha256=read_sidecar(path))
    assert ei.value.exit_code == 1 and "sha256" in ei.value.message


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_read_with_hash_reads_the_file_once_and_detects_a_flipped_byte(tmp_path):
    """read_bin(expected_sha256=...) reads each byte once: hashing rides on the data read."""
    n = 350_000  # 4.2 MB
    rng = np.random.default_rng(5)
    w, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    path = tmp_path / bin_name(9)
    digest = save_bin(path, 9, w, m, v)
    size = path.stat().st_size
    assert size == 8 + 12 * n
    before = rchar()
    c = read_bin(path, expected_n=n, expected_sha256=digest.sha256)
    read = rchar() - before
    assert size <= read < 1.2 * size, f"read {read} bytes for a {size}-byte file"
    assert c.digest == digest
    for a, b in ((c.weights, w), (c.m, m), (c.v, v)):
        np.testing.assert_array_equal(a, b)
    # mmap: hashing the mapped memory reads nothing through read(2)
    before = rchar()
    cm = read_bin(path, expected_sha256=digest.sha256, mmap=True)
    assert rchar() - before < 0.2 * size and cm.digest == digest
    np.testing.assert_array_equal(cm.v, v)
    del cm
    # one flipped bit in each region (and in the last byte) is still caught, both ways
    good = path.read_bytes()
    for offset in (8, 8 + 4 * n + 12345, 8 + 8 * n + 7, size - 1):
        data = bytearray(good)
        data[offset] ^= 0x10
        path.write_bytes(bytes(data))
        for use_mmap in (False, True):
            with pytest.raises(IntegrityError, match="sha256 mismatch") as ei:
                read_bin(path, expected_sha256=digest.sha256, mmap=use_mmap)
            err = ei.value
            assert err.exit_code == 1 and err.file == str(path)
            assert err.expected == digest.sha256
            assert err.found == hashlib.sha256(bytes(data)).hexdigest() != digest.sha256
    path.write_bytes(good)
    assert read_bin(path, expected_sha256=digest.sha256.upper()).digest == digest  # hex case-insensitive


def test_sidecar_is_optional_without_is_absent_and_sidecar_false(tmp_path):
    path = tmp_path / bin_name(1)
    save_bin(path, 1, f32([1]), f32([0]), f32([0]), sidecar=False)
    assert not sidecar_path(path).exists()
    assert read_bin(path).step == 1


# ---- streaming writes from per-parameter chunks ---------------------------------------


def test_chunked_and_odd_layouts_write_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(ab, "_PIECE_ELEMS", 3)  # force many small pieces per chunk
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 5, generator=g)
    b = torch.randn(7, generator=g)
    at = a.t()  # non-contiguous: written in logical (row-major) order of a.t()
    w_chunks = [at, b, torch.zeros(()).expand(6)]  # zero-stride view: no storage
    m_chunks = [np.ascontiguousarray(at.numpy()).astype(">f4"), b.numpy(), np.zeros(6, np.float32)]
    v_chunks = [torch.full((30,), 2.5), torch.ones(3)]
    n = 20 + 7 + 6
    with StagedFile(tmp_path / "chunked.bin") as f:
        h = write_bin(f, 5, w_chunks, m_chunks, v_chunks)
        f.finish()
        f.publish()
    assert (h.step, h.n_params) == (5, n)
    flat_w = np.concatenate([at.contiguous().numpy().ravel(), b.numpy(), np.zeros(6, np.float32)])
    expected = struct.pack("<ii", 5, n) + flat_w.astype("<f4").tobytes() * 2
    expected += np.concatenate([np.full(30, 2.5, np.float32), np.ones(3, np.float32)]).astype("<f4").tobytes()
    assert (tmp_path / "chunked.bin").read_bytes() == expected


def test_write_refuses_bad_arguments_before_writing_a_byte(tmp_path):
    ok = f32([1, 2])

    def attempt(step, w, m, v):
        final = tmp_path / "x.bin"
        with StagedFile(final) as f:
            try:
                write_bin(f, step, w, m, v)
            finally:
                assert f.size == 0  # nothing streamed before the refusal
        raise AssertionError("write_bin accepted bad arguments")

    cases = [
        (BadInput, (-1, ok, ok, ok)),
        (SaveFailed, (2**31, ok, ok, ok)),
        (BadInput, (True, ok, ok, ok)),
        (BadInput, (1, ok.astype(np.float64), ok, ok)),
        (BadInput, (1, torch.tensor([1.0, 2.0], dtype=torch.float16), ok, ok)),
        (BadInput, (1, ok, f32([1]), ok)),  # lengths differ
        (BadInput, (1, ok, ok, [ok, ok])),
        (BadInput, (1, f32([]), f32([]), f32([]))),  # n = 0
        (BadInput, (1, torch.empty(2, device="meta"), ok, ok)),
        (BadInput, (1, [1.0, 2.0], ok, ok)),  # a list of floats is not a chunk
    ]
    for exc, args in cases:
        with pytest.raises(exc) as ei:
            attempt(*args)
        assert ei.value.exit_code == 2, args
        assert ei.value.file is not None
    assert list(tmp_path.iterdir()) == []  # temporaries removed, nothing published

    # a staged file that already holds bytes cannot become a .bin
    with StagedFile(tmp_path / "y.bin") as f:
        f.write(b"junk")
        with pytest.raises(BadInput):
            write_bin(f, 1, ok, ok, ok)


def test_refuses_more_than_int32_params_without_allocating(tmp_path):
    # zero-stride numpy views: 2**31 floats "long", no memory behind them
    huge = np.broadcast_to(np.float32(0), (2**31,))
    half = np.broadcast_to(np.float32(0), (2**30,))
    for region in (huge, [half, half], [huge[:-1], f32([0, 0])]):
        final = tmp_path / "big.bin"
        with StagedFile(final) as f, pytest.raises(SaveFailed) as ei:
            write_bin(f, 1, region, region, region)
        assert f.size == 0
        err = ei.value
        assert err.exit_code == 2
        assert "too large" in err.message and str(MAX_PARAMS) in str(err.expected)
        assert "2147483648" in str(err.found) or "2147483649" in str(err.found)
        assert not final.exists()
    # and the same for torch meta tensors (shapes, no storage): the count is checked first
    meta = torch.empty(2**31, device="meta")
    with StagedFile(tmp_path / "meta.bin") as f, pytest.raises(SaveFailed):
        write_bin(f, 1, meta, meta, meta)
    check_n_params(MAX_PARAMS)  # the boundary itself is allowed
    with pytest.raises(SaveFailed):
        check_n_params(MAX_PARAMS + 1)


# ---- validation of what is read ------------------------------------------------------


def test_truncated_at_every_header_offset(tmp_path):
    _, data = valid_file(tmp_path, n=4)
    for cut in range(0, 9):
        path = write_raw(tmp_path / f"cut{cut}.bin", data[:cut])
        for fn in (read_header, read_bin):
            with pytest.raises(IntegrityError) as ei:
                fn(path)
            err = ei.value
            assert err.exit_code == 1
            assert err.file == str(path) and err.expected and err.found is not None and err.hint
            if cut < 8:
                assert "header" in err.message or "empty" in err.message
                assert f"{cut} bytes" in str(err.found)
            else:
                assert "truncated" in err.message and "48 missing" in str(err.found)


def test_truncated_at_random_offsets(tmp_path):
    _, data = valid_file(tmp_path, n=50)
    rnd = random.Random(1234)
    cuts = sorted({9, len(data) - 1, *(rnd.randrange(9, len(data)) for _ in range(40))})
    for cut in cuts:
        path = write_raw(tmp_path / "cut.bin", data[:cut])
        with pytest.raises(IntegrityError) as ei:
            read_bin(path, expected_n=50)
        assert "truncated" in ei.value.message
        assert f"{len(data)} bytes" in str(ei.value.expected)
        assert f"{len(data) - cut} missing" in str(ei.value.found)


def test_trailing_bytes_named_distinctly(tmp_path):
    _, data = valid_file(tmp_path, n=4)
    for extra in (b"\x00", b"\x00" * 11, b"\x00" * 12):
        path = write_raw(tmp_path / "trail.bin", data + extra)
        with pytest.raises(IntegrityError) as ei:
            read_bin(path)
        assert "trailing" in ei.value.message
        assert f"{len(extra)} extra" in str(ei.value.found)
        assert ei.value.exit_code == 1
    # a header whose n disagrees with a well-formed size gets a hint about the header
    assert "n_params=5" in (ei.value.hint or "")


@pytest.mark.parametrize("n", [0, -1, -(2**31)])
def test_invalid_n_params(tmp_path, n):
    path = write_raw(tmp_path / "n.bin", header_bytes(1, n) + b"\x00" * 36)
    with pytest.raises(IntegrityError) as ei:
        read_header(path)
    assert "parameter count" in ei.value.message and ei.value.found == n
    assert ei.value.exit_code == 1


def test_negative_step(tmp_path):
    path = write_raw(tmp_path / "s.bin", header_bytes(-5, 1) + b"\x00" * 12)
    with pytest.raises(IntegrityError) as ei:
        read_bin(path)
    assert "negative step" in ei.value.message and ei.value.found == -5


def test_expected_n_mismatch(tmp_path):
    path, _ = valid_file(tmp_path, n=4)
    assert read_header(path, expected_n=4).n_params == 4
    with pytest.raises(SchemaError) as ei:
        read_bin(path, expected_n=5)
    assert isinstance(ei.value, IntegrityError) and ei.value.exit_code == 1
    assert "5" in str(ei.value.expected) and "4" in str(ei.value.found)


@pytest.mark.parametrize("region", ["weights", "m", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_region_and_first_index(tmp_path, region, bad):
    n = 10
    arrays = {r: np.ones(n, np.float32) for r in ("weights", "m", "v")}
    arrays[region][6] = bad
    arrays[region][8] = bad
    path = tmp_path / bin_name(3)
    save_bin(path, 3, arrays["weights"], arrays["m"], arrays["v"], sidecar=False)
    c = read_bin(path)  # off by default: the values load as they are
    assert not np.isfinite(getattr(c, region)[6])
    with pytest.raises(IntegrityError) as ei:
        read_bin(path, check_finite=True)
    err = ei.value
    assert err.exit_code == 1 and region in err.message
    assert f"{region}[6]" in str(err.found)
    offset = 8 + {"weights": 0, "m": 4 * n, "v": 8 * n}[region] + 4 * 6
    assert f"byte offset {offset}" in str(err.found)
    with pytest.raises(IntegrityError):
        read_bin(path, check_finite=True, mmap=True)


def test_not_a_regular_file_is_bad_input(tmp_path):
    folder = tmp_path / "step_000001.bin"
    folder.mkdir()
    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)
    missing = tmp_path / "nothing.bin"
    for path in (folder, fifo, missing):
        for fn in (read_header, read_bin):
            with pytest.raises(BadInput) as ei:
                fn(path)  # a FIFO must not block
            assert ei.value.exit_code == 2 and ei.value.file == str(path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads anything")
def test_unreadable_file_is_bad_input(tmp_path):
    path, _ = valid_file(tmp_path)
    path.chmod(0)
    try:
        with pytest.raises(BadInput):
            read_bin(path)
    finally:
        path.chmod(0o644)


def test_open_failure_is_bad_input(tmp_path, monkeypatch):
    """An open refused by the OS (as for an unreadable file, even when run as root)."""
    path, _ = valid_file(tmp_path)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ab.os, "open", refuse)
    with pytest.raises(BadInput) as ei:
        read_bin(path)
    assert ei.value.exit_code == 2 and "Permission denied" in str(ei.value.found)


@pytest.fixture(scope="module")
def prop_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prop")


int32 = st.integers(-(2**31), 2**31 - 1)
small = st.integers(-2, 6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    step=st.one_of(small, int32),
    n=st.one_of(small, int32),
    size=st.integers(0, 64),
    expected_n=st.one_of(st.none(), st.integers(1, 5)),
    fill=st.binary(min_size=56, max_size=56),
)
def test_read_header_property(prop_dir, step, n, size, expected_n, fill):
    data = (header_bytes(step, n) + fill)[:size]
    path = write_raw(prop_dir / "p.bin", data)
    valid = size >= 8 and step >= 0 and n >= 1 and size == 8 + 12 * n
    fits = valid and (expected_n is None or expected_n == n)
    try:
        h = read_header(path, expected_n=expected_n)
    except RipresaError as err:
        assert not fits, (step, n, size, expected_n, err)
        assert isinstance(err, IntegrityError) and err.exit_code == 1
        assert isinstance(err, SchemaError) == (valid and not fits)
        return
    assert fits
    assert (h.step, h.n_params) == (step, n)


# ---- model + AdamW: exact resume --------------------------------------------------------


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    ).float()


def batches(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(k)]


def train(model, opt, data) -> None:
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


OPT_KW = {"lr": 3e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("impl", [{}, {"foreach": True}, {"fused": True}], ids=["for", "foreach", "fused"])
@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_resume_from_bin_is_bit_exact(tmp_path, impl, mmap):
    data = batches(6)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW, **impl)
    train(model, opt, data[:3])
    step = adamw_step(model, opt)
    assert step == 3
    path = tmp_path / bin_name(step)
    arrays = flatten_model_and_adamw(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert arrays.n_params == n
    save_bin(path, step, *arrays)
    assert path.stat().st_size == 8 + 12 * n

    fresh = make_model(1)  # different initial weights
    fresh_opt = torch.optim.AdamW(fresh.parameters(), **OPT_KW, **impl)  # no state yet
    contents = read_bin(path, expected_n=n, check_finite=True, expected_sha256=read_sidecar(path), mmap=mmap)
    notes = load_into_model_and_adamw(contents, fresh, fresh_opt)
    assert notes == []
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        s, t = opt.state[p], fresh_opt.state[q]
        assert set(s) == set(t)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], t[key]) and s[key].stride() == t[key].stride()
        assert s["step"].dtype == t["step"].dtype and s["step"].device == t["step"].device
        assert torch.equal(s["step"], t["step"])

    train(model, opt, data[3:])
    train(fresh, fresh_opt, data[3:])
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    # the checkpoint on disk was not touched by loading or training
    assert read_bin(path, expected_sha256=read_sidecar(path)).step == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", [{"capturable": True}, {"fused": True}], ids=["capturable", "fused"])
def test_resume_on_cuda_keeps_step_on_device(tmp_path, impl):
    data = [(x.cuda(), y.cuda()) for x, y in batches(6)]
    model = make_model(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW, **impl)
    train(model, opt, data[:3])
    path = tmp_path / bin_name(3)
    save_bin(path, 3, *flatten_model_and_adamw(model, opt))  # GPU chunks, copied piecewise
    fresh = make_model(1).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), **OPT_KW, **impl)
    load_into_model_and_adamw(read_bin(path), fresh, fresh_opt)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        s, t = opt.state[p]["step"], fresh_opt.state[q]["step"]
        assert (s.device, s.dtype) == (t.device, t.dtype) and torch.equal(s, t)
    train(model, opt, data[3:])
    train(fresh, fresh_opt, data[3:])
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_weights_only_resume_diverges(tmp_path):
    """Control: the bit-exact comparison above would catch lost m/v/step."""
    data = batches(6)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    train(model, opt, data[:3])
    path = tmp_path / bin_name(3)
    save_bin(path, 3, *flatten_model_and_adamw(model, opt))
    c = read_bin(path)
    fresh = make_model(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), **OPT_KW)
    zeros = np.zeros_like(c.m)
    load_into_model_and_adamw(ab.BinContents(c.path, 0, c.n_params, c.weights, zeros, zeros), fresh, fresh_opt)
    train(model, opt, data[3:])
    train(fresh, fresh_opt, data[3:])
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))


def test_channels_last_parameters_round_trip(tmp_path):
    """Conv weights in channels_last are flattened in logical order both ways."""

    def conv_model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(36, 2)).to(
            memory_format=torch.channels_last
        )

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 3, 5, 5, generator=g), torch.randn(2, 2, generator=g)) for _ in range(4)]
    model = conv_model(0)
    assert not model[0].weight.is_contiguous()
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    train(model, opt, data[:2])
    save_bin(tmp_path / bin_name(2), 2, *flatten_model_and_adamw(model, opt))
    fresh = conv_model(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), **OPT_KW)
    load_into_model_and_adamw(read_bin(tmp_path / bin_name(2)), fresh, fresh_opt)
    train(model, opt, data[2:])
    train(fresh, fresh_opt, data[2:])
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_load_refusals_leave_model_and_optimizer_untouched(tmp_path):
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    train(model, opt, batches(1))
    path = tmp_path / bin_name(1)
    save_bin(path, 1, *flatten_model_and_adamw(model, opt))
    c = read_bin(path)

    target = make_model(1)
    before = [p.detach().clone() for p in target.parameters()]

    def untouched(o):
        assert all(torch.equal(a, b) for a, b in zip(before, target.parameters(), strict=True))
        assert len(o.state) == 0

    o = torch.optim.AdamW(target.parameters(), **OPT_KW, amsgrad=True)
    with pytest.raises(BadInput, match="amsgrad"):
        load_into_model_and_adamw(c, target, o)
    untouched(o)

    o = torch.optim.SGD(target.parameters(), lr=0.1)
    with pytest.raises(BadInput, match="Adam"):
        load_into_model_and_adamw(c, target, o)
    untouched(o)

    other = torch.nn.Linear(2, 2)
    o = torch.optim.AdamW([*target.parameters(), *other.parameters()], **OPT_KW)
    with pytest.raises(BadInput, match="not in the model"):
        load_into_model_and_adamw(c, target, o)
    untouched(o)

    bigger = torch.nn.Sequential(target, torch.nn.Linear(3, 1))
    o = torch.optim.AdamW(bigger.parameters(), **OPT_KW)
    with pytest.raises(SchemaError) as ei:
        load_into_model_and_adamw(c, bigger, o)
    assert ei.value.exit_code == 1
    untouched(o)

    double = make_model(1).double()
    o = torch.optim.AdamW(double.parameters(), **OPT_KW)
    with pytest.raises(BadInput, match="float32"):
        load_into_model_and_adamw(c, double, o)
    with pytest.raises(BadInput, match="float32"):
        flatten_model_and_adamw(double, o)


def test_frozen_parameter_outside_the_optimizer(tmp_path):
    model = make_model(0)
    model[0].weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, **OPT_KW)
    train(model, opt, batches(2))
    arrays = flatten_model_and_adamw(model, opt)
    assert arrays.m[0].stride() == (0,)  # zero view, no memory
    path = tmp_path / bin_name(2)
    save_bin(path, 2, *arrays)
    c = read_bin(path)
    k = model[0].weight.numel()
    assert not c.m[:k].any() and not c.v[:k].any() and c.m[k:].any()

    fresh = make_model(1)
    fresh[0].weight.requires_grad_(False)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], **OPT_KW)
    notes = load_into_model_and_adamw(c, fresh, fresh_opt)
    assert any("0.weight" in s and "not in the optimizer" in s for s in notes)
    assert fresh[0].weight not in fresh_opt.state
    assert torch.equal(fresh[0].weight, model[0].weight)

    # non-zero moments for a parameter the optimizer does not hold: refused
    m = c.m.copy()
    m[0] = 1.0
    with pytest.raises(BadInput, match="does not hold"):
        load_into_model_and_adamw(ab.BinContents(c.path, 2, c.n_params, c.weights, m, c.v), fresh, fresh_opt)


def test_adamw_step_and_missing_state():
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    assert adamw_step(model, opt) == 0
    arrays = flatten_model_and_adamw(model, opt)  # fresh optimizer: zero views
    assert all(t.stride() == (0,) and not t.any() for t in (*arrays.m, *arrays.v))
    train(model, opt, batches(2))
    assert adamw_step(model, opt) == 2
    next(iter(opt.state.values()))["step"] += 1
    with pytest.raises(BadInput, match="differ"):
        adamw_step(model, opt)


def test_buffers_are_reported_not_restored(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    save_bin(tmp_path / bin_name(0), 0, *flatten_model_and_adamw(model, opt))
    notes = load_into_model_and_adamw(read_bin(tmp_path / bin_name(0)), model, opt)
    assert any("buffer" in s and "running_mean" in s for s in notes)


# ---- foreign .bin ---------------------------------------------------------------------


def test_foreign_bin_loads_and_reports_what_is_missing(tmp_path):
    path = write_raw(tmp_path / "from_other_engine.bin", G_BYTES)
    c = read_bin(path)  # no sidecar, no companion: still loads
    assert c.step == 7 and c.digest is None
    missing = describe_missing(path)
    text = "\n".join(missing)
    assert "sha256 sidecar" in text and "companion" in text
    for item in BIN_LACKS:
        assert item in text
    assert "random generator" in text and "data position" in text and "scheduler" in text

    model = torch.nn.Linear(2, 1)  # weight (1, 2) then bias (1,): 3 parameters
    opt = torch.optim.AdamW(model.parameters(), **OPT_KW)
    load_into_model_and_adamw(c, model, opt)
    assert model.weight.tolist() == [[1.0, 2.0]] and model.bias.item() == 3.0
    assert opt.state[model.weight]["exp_avg"].tolist() == [[0.5, -0.25]]
    assert opt.state[model.bias]["exp_avg_sq"].item() == 4.0
    assert opt.state[model.bias]["step"].item() == 7.0

    # a ripresa generation with sidecar and companion lacks nothing the .bin can tell
    shutil.copy(FIXTURES / "step_000007.bin", tmp_path / "step_000007.bin")
    shutil.copy(FIXTURES / "step_000007.bin.sha256", tmp_path / "step_000007.bin.sha256")
    only_side = describe_missing(tmp_path / "step_000007.bin")
    assert only_side and not any("sidecar" in s for s in only_side)
    companion_path(tmp_path / "step_000007.bin").write_text("{}")
    assert describe_missing(tmp_path / "step_000007.bin") == []
