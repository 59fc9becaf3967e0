"""Text sources are deterministic, capped bytes; CropSampler resumes exactly."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch

from ripresa import BadInput, RandomStreams
from ripresa.engine.gpt import sources as S
from ripresa.engine.gpt.sources import (
    BUILTIN_SOURCES,
    DEFAULT_MAX_BYTES,
    CropSampler,
    TextSource,
    builtin_source,
    load_sources,
    load_text_source,
    stdlib_files,
)
from ripresa.errors import IdentityMismatch, SchemaError

# ---- built-in sources ----------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTIN_SOURCES)
def test_builtin_sources_are_deterministic_nonempty_capped_and_read_only(name):
    src = builtin_source(name)
    assert builtin_source(name) is src  # memoised per process
    assert 0 < len(src) <= DEFAULT_MAX_BYTES[name]
    assert src.sha256 == hashlib.sha256(src.data.tobytes()).hexdigest()
    assert src.data.dtype == np.uint8 and src.data.ndim == 1 and not src.data.flags.writeable
    with pytest.raises(ValueError):
        src.data[0] = 0
    assert src.origin


@pytest.mark.parametrize("name", BUILTIN_SOURCES)
def test_two_real_builds_give_the_same_bytes(name):
    first = S._build_builtin.__wrapped__(name, 100_000)  # bypass the per-process memo
    second = S._build_builtin.__wrapped__(name, 100_000)
    assert first is not second and first.sha256 == second.sha256 and len(first) == 100_000


@pytest.mark.parametrize("name", BUILTIN_SOURCES)
def test_a_smaller_cap_is_a_prefix_of_exactly_that_size(name):
    small = builtin_source(name, max_bytes=10_000)
    assert len(small) == 10_000
    assert np.array_equal(small.data, builtin_source(name).data[:10_000])
    assert small.sha256 != builtin_source(name).sha256


def test_stdlib_files_are_sorted_and_exclude_tests_packages_and_build_files():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert "ast.py" in files and "json/decoder.py" in files
    for f in files:
        parts = f.split("/")
        assert not {"site-packages", "test", "tests", "idlelib", "__pycache__"} & set(parts), f
        assert not parts[-1].startswith("_sysconfigdata"), f


def test_builtin_contents_look_right():
    code = builtin_source("stdlib-code").text(0, 200_000)
    assert code.startswith("==> __future__.py <==\n") and "\ndef " in code
    docs = builtin_source("stdlib-docstrings").text()
    assert docs.startswith("==> __future__.py <==\nRecord of phased-in incompatible language changes.")
    assert '"""' not in docs[:10_000]  # text of the docstrings, not their quotes
    topics = builtin_source("pydoc-topics").text()
    headers = [line[4:-4] for line in topics.splitlines() if line.startswith("==> ") and line.endswith(" <==")]
    assert headers == sorted(headers) and "assert" in headers


def test_unknown_builtin_and_bad_caps_are_refused():
    with pytest.raises(BadInput, match="unknown built-in"):
        builtin_source("wikipedia")
    for cap in (0, -1, 1.5, True):
        with pytest.raises(BadInput):
            builtin_source("pydoc-topics", max_bytes=cap)


# ---- your own text --------------------------------------------------------------------


def test_load_text_source_file_is_served_byte_for_byte(tmp_path):
    f = tmp_path / "notes.txt"
    raw = "città — più byte\n".encode() * 50
    f.write_bytes(raw)
    src = load_text_source("notes", f)
    assert src.name == "notes" and src.data.tobytes() == raw
    assert src.sha256 == hashlib.sha256(raw).hexdigest()
    assert len(load_text_source("notes", f, max_bytes=7)) == 7


def test_load_text_source_folder_sorted_skipping_hidden_and_binary(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"zed")
    (tmp_path / "a.txt").write_bytes(b"alpha\n")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    src = load_text_source("mine", tmp_path)
    assert src.data.tobytes() == b"==> a.txt <==\nalpha\n\n==> b/z.txt <==\nzed\n\n"
    assert load_text_source("mine", tmp_path).sha256 == src.sha256  # deterministic
    assert "2 text files" in src.origin


def test_load_text_source_bad_paths_are_refused(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        load_text_source("x", tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(BadInput, match="empty"):
        load_text_source("x", tmp_path / "empty.txt")
    (tmp_path / "blob.bin").write_bytes(b"PK\x00\x03")
    with pytest.raises(BadInput, match="binary"):
        load_text_source("x", tmp_path / "blob.bin")
    only_binary = tmp_path / "bins"
    only_binary.mkdir()
    (only_binary / "a.bin").write_bytes(b"\x00")
    with pytest.raises(BadInput, match="empty"):
        load_text_source("x", only_binary)
    with pytest.raises(BadInput, match="name"):
        load_text_source("../evil", tmp_path / "blob.bin")


def test_load_sources_from_specs(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"hello world\n")
    got = load_sources(["pydoc-topics", f"mine={tmp_path / 't.txt'}"])
    assert list(got) == ["pydoc-topics", "mine"]
    with pytest.raises(BadInput, match="twice"):
        load_sources(["pydoc-topics", "pydoc-topics"])
    with pytest.raises(BadInput, match="bad data source"):
        load_sources(["no-such-thing"])


# ---- CropSampler -------------------------------------------------------------------------


def _src(name: str, raw: bytes) -> TextSource:
    return TextSource.from_bytes(name, raw, "test")


ARMS = {
    "digits": _src("digits", bytes(range(48, 58)) * 40),
    "letters": _src("letters", bytes(range(97, 123)) * 30),
}


def test_batch_is_windows_of_the_source_drawn_with_one_integers_call():
    T, B = 16, 5
    sampler = CropSampler(ARMS, T, B, np.random.default_rng(3))
    twin = np.random.default_rng(3)
    x, y, offsets = sampler.batch("letters")
    n = len(ARMS["letters"])
    assert offsets == twin.integers(0, n - T, size=B, dtype=np.int64).tolist()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    data = ARMS["letters"].data
    for b, o in enumerate(offsets):
        assert 0 <= o <= n - T - 1
        assert x[b].tolist() == data[o : o + T].tolist()
        assert y[b].tolist() == data[o + 1 : o + T + 1].tolist()
    assert sampler.batches == {"digits": 0, "letters": 1} and sampler.tokens["letters"] == B * T
    assert sampler.generator.bit_generator.state == twin.bit_generator.state  # exactly B draws


def test_offsets_reach_both_ends_of_the_source():
    T = 8
    tight = CropSampler({"t": _src("t", bytes(range(T + 2)))}, T, 64, np.random.default_rng(0))
    _, y, offsets = tight.batch("t")
    assert set(offsets) == {0, 1}  # len - T - 1 = 1 is the last valid offset
    assert y.max().item() == T + 1  # the last byte is a target


def test_short_source_unknown_arm_and_bad_args_are_refused():
    with pytest.raises(BadInput, match="shorter than one training window"):
        CropSampler({"s": _src("s", b"x" * 16)}, 16, 2, np.random.default_rng(0))
    CropSampler({"s": _src("s", b"x" * 17)}, 16, 2, np.random.default_rng(0))  # exactly T + 1 is enough
    sampler = CropSampler(ARMS, 8, 2, np.random.default_rng(0))
    with pytest.raises(BadInput, match="unknown data arm"):
        sampler.batch("repo-docstrings")
    with pytest.raises(BadInput):
        CropSampler(ARMS, 8, 2, np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        CropSampler({}, 8, 2, np.random.default_rng(0))
    with pytest.raises(BadInput):
        CropSampler(ARMS, 0, 2, np.random.default_rng(0))


def _schedule(i: int) -> str:
    return "digits" if i % 3 else "letters"


@pytest.mark.parametrize("cut", [0, 1, 4, 9])
def test_exact_resume_with_random_streams(cut):
    T, B, total = 12, 4, 12
    ref = CropSampler(ARMS, T, B, np.random.default_rng(11))
    reference = [ref.batch(_schedule(i))[2] for i in range(total)]

    gen = np.random.default_rng(11)
    a = CropSampler(ARMS, T, B, gen)
    head = [a.batch(_schedule(i))[2] for i in range(cut)]
    buf = io.BytesIO()
    torch.save({"data": a.state_dict(), "rng": RandomStreams(numpy={"data": gen}).state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    gen_b = np.random.default_rng(999)  # restoring must not depend on the new seed
    b = CropSampler(ARMS, T, B, gen_b)
    b.load_state_dict(saved["data"])
    RandomStreams(numpy={"data": gen_b}).load_state_dict(saved["rng"])
    tail = [b.batch(_schedule(i))[2] for i in range(cut, total)]
    assert head + tail == reference
    assert b.batches == ref.batches and b.tokens == ref.tokens


def test_data_identity_and_strict_state_checks():
    sampler = CropSampler(ARMS, 8, 2, np.random.default_rng(0))
    assert sampler.data_identity() == {k: v.sha256 for k, v in ARMS.items()}
    sampler.batch("digits")
    state = sampler.state_dict()

    other_batch = CropSampler(ARMS, 8, 3, np.random.default_rng(0))
    with pytest.raises(SchemaError, match="batch_size"):
        other_batch.load_state_dict(state)
    fewer = CropSampler({"digits": ARMS["digits"]}, 8, 2, np.random.default_rng(0))
    with pytest.raises(SchemaError, match="arms differ"):
        fewer.load_state_dict(state)
    changed = CropSampler(
        {"digits": _src("digits", b"0123456789" * 41), "letters": ARMS["letters"]}, 8, 2, np.random.default_rng(0)
    )
    with pytest.raises(IdentityMismatch, match="digits"):
        changed.load_state_dict(state)
    with pytest.raises(SchemaError, match="lacks"):
        sampler.load_state_dict({"arms": {}})


def test_non_strict_load_drops_zombie_arms_and_starts_new_ones_at_zero():
    old = CropSampler(ARMS, 8, 2, np.random.default_rng(0))
    old.batch("letters")
    old.batch("letters")
    new_arms = {"digits": ARMS["digits"], "more": _src("more", b"m" * 100)}
    new = CropSampler(new_arms, 8, 2, np.random.default_rng(0))
    new.load_state_dict(old.state_dict(), strict=False)
    assert new.batches == {"digits": 0, "more": 0}
    assert new.dropped_arms["letters"]["batches"] == 2
    with pytest.raises(BadInput):
        new.batch("letters")


def test_a_saved_sampler_state_is_checked_once_for_sizes_and_counts(tmp_path):
    """One check (check_sampler_state) for a resume and for ``export --verify`` through the GPT factory: a
    hostile size or count is a SchemaError naming the field, never accepted (the fuzzer's bundle cases)."""
    import pytest

    from ripresa.engine.gpt.factory import GPT_FACTORY
    from ripresa.engine.gpt.sources import check_sampler_state
    from ripresa.errors import SchemaError

    good = {"block_size": 8, "batch_size": 4, "arms": {"code": {"sha256": "0" * 64, "length": 100, "batches": 3,
                                                              "tokens": 96}}}
    check_sampler_state(good, block_size=8, batch_size=4)
    cfg = {"model": {"block_size": 8}, "train": {"batch_size": 4}}
    GPT_FACTORY.check_resume_state(cfg, {"data": good}, tmp_path / "step_000004.json")
    for key, value in (("batch_size", 10**19), ("block_size", -1), ("batch_size", 4.0)):
        with pytest.raises(SchemaError, match=key):
            GPT_FACTORY.check_resume_state(cfg, {"data": {**good, key: value}}, tmp_path / "step_000004.json")
    with pytest.raises(SchemaError, match="saved with batch_size=5"):
        GPT_FACTORY.check_resume_state(cfg, {"data": {**good, "batch_size": 5}}, tmp_path / "c.json")
    with pytest.raises(SchemaError, match="tokens"):
        check_sampler_state({**good, "arms": {"code": {**good["arms"]["code"], "tokens": -1}}})
