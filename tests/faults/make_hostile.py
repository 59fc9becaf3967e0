"""Generate tests/fixtures/hostile/: small malformed and malicious files, kept as test cases.

    python tests/faults/make_hostile.py          # (re)write the fixtures and manifest.json

Like safetensors' ``attacks/``: every file is tiny and committed, and
``manifest.json`` says how each one is read and what must happen (the error
class, a phrase of the message, and for pickles that nothing ran).
``tests/test_faults_inputs.py`` runs them all.

Families:

* ``bin``        — ANDREA ``.bin`` files read with :func:`ripresa.formats.andrea_bin.read_bin`;
* ``pt``         — ``checkpoint.pt`` files (each with a *matching* ``.sha256``:
  the attacker can write both) read with :func:`ripresa.load_checkpoint`;
* ``sidecar``    — ``.sha256`` sidecars for ``target.bin`` (:func:`ripresa.io.fsio.verify_against_sidecar`);
* ``marker``     — two-line generation markers (placeholders ``@BIN_SHA@``, ``@COMP_SHA@``);
* ``companion``  — generation companions (placeholders ``@BIN_SHA@``, ``@BIN_SIZE@``, ``@N@``;
  the test rewrites the marker to match, so only the intended defect remains).

The payloads of the pickles only ever try to create a file named
``PWNED_BY_RIPRESA_FIXTURE`` in the current folder; the test runs them in a
scratch folder and checks that it never appears.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "hostile"
PWNED = "PWNED_BY_RIPRESA_FIXTURE"
N = 16  # parameters of the small .bin fixtures


def _bin(step: int, n_header: int, n_data: int, fill: float = 0.25) -> bytes:
    data = np.full(3 * n_data, fill, dtype="<f4")
    data[: n_data] = np.arange(n_data, dtype="<f4") / 7
    return struct.pack("<ii", step, n_header) + data.tobytes()


class _Payload:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _tiny_state() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from faults.common import tiny_pt_state

    return tiny_pt_state()


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rezip(data: bytes, replace: dict[str, bytes] | None = None, rename=None) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            body = (replace or {}).get(info.filename.split("/", 1)[-1], src.read(info.filename))
            z.writestr(rename(info.filename) if rename else info.filename, body)
    return out.getvalue()


def _huge_storage_pickle(numel: int, shape: int) -> bytes:
    """The data.pkl of ``{"a": tensor}`` with a forged storage size and shape."""
    base = _torch_bytes({"a": torch.arange(4, dtype=torch.float32)})
    z = zipfile.ZipFile(io.BytesIO(base))
    name = next(n for n in z.namelist() if n.endswith("data.pkl"))
    pk = z.read(name)
    # the two BININT1 4 opcodes (b"K\x04"): the storage numel, then the size tuple
    first = pk.index(b"K\x04")
    second = pk.index(b"K\x04", first + 2)
    big = lambda v: b"\x8a\x08" + struct.pack("<q", v)  # noqa: E731 - LONG1, 8 bytes
    pk = pk[:first] + big(numel) + pk[first + 2 : second] + big(shape) + pk[second + 2 :]
    return _rezip(base, {"data.pkl": pk})


def build() -> list[dict]:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    cases: list[dict] = []

    def put(name: str, data: bytes, family: str, expect: str, match: str, **opts) -> None:
        (OUT / name).write_bytes(data)
        cases.append({"name": name, "family": family, "expect": expect, "match": match, **opts})

    # ---- .bin ------------------------------------------------------------------------
    good = _bin(7, N, N)
    for k in range(8):
        put(f"bin_truncated_at_{k}.bin", good[:k], "bin", "IntegrityError", "empty" if k == 0 else "inside its header")
    put("bin_header_only.bin", good[:8], "bin", "IntegrityError", "truncated")
    put("bin_truncated_mid.bin", good[:100], "bin", "IntegrityError", "truncated")
    put("bin_truncated_last_byte.bin", good[:-1], "bin", "IntegrityError", "truncated")
    put("bin_n_params_0.bin", _bin(7, 0, 0), "bin", "IntegrityError", "invalid parameter count")
    put("bin_n_params_minus_1.bin", _bin(7, -1, N), "bin", "IntegrityError", "invalid parameter count")
    put("bin_n_params_int32_max.bin", _bin(7, 2**31 - 1, N), "bin", "IntegrityError", "truncated")
    put("bin_n_params_mismatched.bin", _bin(7, N + 4, N), "bin", "IntegrityError", "truncated")
    put("bin_n_params_vs_model.bin", good, "bin", "SchemaError", "parameter counts differ", expected_n=N + 1)
    put("bin_step_negative.bin", _bin(-1, N, N), "bin", "IntegrityError", "negative step")
    put("bin_trailing_1_byte.bin", good + b"\0", "bin", "IntegrityError", "trailing bytes")
    put("bin_trailing_12_bytes.bin", good + bytes(12), "bin", "IntegrityError", "trailing bytes")
    for region, value, word in (("weights", np.nan, "nan"), ("m", np.inf, "inf"), ("v", -np.inf, "neginf")):
        arr = np.frombuffer(good[8:], dtype="<f4").copy()
        arr[{"weights": 0, "m": N, "v": 2 * N}[region] + 3] = value
        data = good[:8] + arr.tobytes()
        put(f"bin_{word}_in_{region}.bin", data, "bin", "IntegrityError", f"non-finite value in {region}", check_finite=True)
        cases.append({"name": f"bin_{word}_in_{region}.bin", "family": "bin", "expect": "load", "match": "",
                      "check_finite": False, "note": "without --check-finite a non-finite value is data, not damage"})

    # ---- checkpoint.pt (each with a matching sidecar) ---------------------------------------
    state = _tiny_state()

    def put_pt(name: str, data: bytes, expect: str, match: str, **opts) -> None:
        import hashlib

        put(name, data, "pt", expect, match, **opts)
        (OUT / (name + ".sha256")).write_text(f"{hashlib.sha256(data).hexdigest()}  {name}\n")

    small = {"format": "ripresa.checkpoint", "format_version": 1}  # refused while unpickling: no need for more
    evil = dict(small, extra={"payload": _Payload(os.system, (f"touch {PWNED}",))})
    put_pt("pt_os_system.pt", _torch_bytes(evil), "IntegrityError", "safe loader", executes=True)
    evil = dict(small, extra={"payload": _Payload(builtins.exec, (f"open('{PWNED}', 'w').close()",))})
    put_pt("pt_builtins_exec.pt", _torch_bytes(evil), "IntegrityError", "safe loader", executes=True)
    evil = dict(small, extra={"payload": _Payload(subprocess.check_call, (["touch", PWNED],))})
    put_pt("pt_subprocess.pt", _torch_bytes(evil), "IntegrityError", "safe loader", executes=True)
    put_pt("pt_raw_pickle_os_system.pt", pickle.dumps(_Payload(os.system, (f"touch {PWNED}",))), "IntegrityError",
           "not a torch zip archive", executes=True)
    put_pt("pt_numpy_reconstruct.pt", _torch_bytes(dict(small, extra={"arr": np.arange(3)})), "IntegrityError",
           "safe loader")
    put_pt("pt_huge_storage.pt", _huge_storage_pickle(2**40, 4), "IntegrityError", "could not be read")
    put_pt("pt_huge_shape.pt", _huge_storage_pickle(4, 2**40), "IntegrityError", "could not be read")
    good_pt = _torch_bytes(state)
    put_pt("pt_corrupt_zip_directory.pt", good_pt.replace(b"PK\x01\x02", b"XX\x01\x02"), "IntegrityError", "")
    put_pt("pt_truncated_zip.pt", good_pt[: len(good_pt) // 2], "IntegrityError", "not a torch zip archive")
    put_pt("pt_empty.pt", b"", "IntegrityError", "not a torch zip archive")
    put_pt("pt_not_a_dict.pt", _torch_bytes([1, 2, 3]), "SchemaError", "not a dict")
    put_pt("pt_zip_slip.pt", _rezip(good_pt, rename=lambda n: "../../../tmp/ripresa_zip_slip/" + n.split("/", 1)[-1]),
           "IntegrityError", "")
    put_pt("pt_wrong_format.pt", _torch_bytes(dict(state, format="something.else")), "SchemaError", "not a ripresa checkpoint")

    # ---- sidecars for target.bin ----------------------------------------------------------------
    import hashlib

    target = b"payload of target.bin\n"
    (OUT / "sidecar_target.bin").write_bytes(target)
    h = hashlib.sha256(target).hexdigest()
    for name, text, match in (
        ("uppercase_hex", f"{h.upper()}  target.bin\n", "malformed"),
        ("non_hex", f"{'g' * 64}  target.bin\n", "malformed"),
        ("short_hex", f"{h[:63]}  target.bin\n", "malformed"),
        ("long_hex", f"{h}0  target.bin\n", "malformed"),
        ("dotdot_path", f"{h}  ../target.bin\n", "malformed"),
        ("absolute_path", f"{h}  /etc/passwd\n", "malformed"),
        ("other_name", f"{h}  other.bin\n", "names another file"),
        ("two_lines", f"{h}  target.bin\n{h}  target.bin\n", "malformed"),
        ("crlf", f"{h}  target.bin\r\n", "malformed"),
        ("nul_in_name", f"{h}  target.bin\0\n", "malformed"),
        ("empty", "", "malformed"),
        ("no_separator", f"{h}target.bin\n", "malformed"),
        ("huge", f"{h}  target.bin\n" + "#" * 5000, "too large"),
        ("wrong_hash", f"{hashlib.sha256(b'other').hexdigest()}  target.bin\n", "sha256 mismatch"),
    ):
        put(f"sidecar_{name}.sha256", text.encode("latin-1"), "sidecar", "IntegrityError", match)
    put("sidecar_binary.sha256", bytes(range(256)), "sidecar", "IntegrityError", "malformed")

    # ---- generation markers (for step_000002) -----------------------------------------------------
    b, c = "step_000002.bin", "step_000002.json"
    for name, text, match in (
        ("one_line", f"@BIN_SHA@  {b}\n", "malformed commit marker"),
        ("three_lines", f"@BIN_SHA@  {b}\n@COMP_SHA@  {c}\n@COMP_SHA@  {c}\n", "malformed commit marker"),
        ("swapped_hashes", f"@COMP_SHA@  {b}\n@BIN_SHA@  {c}\n", "companion sha256 mismatch"),
        ("dotdot_path", f"@BIN_SHA@  ../{b}\n@COMP_SHA@  {c}\n", "malformed commit marker"),
        ("absolute_path", f"@BIN_SHA@  /abs/{b}\n@COMP_SHA@  {c}\n", "malformed commit marker"),
        ("other_generation", "@BIN_SHA@  step_000001.bin\n@COMP_SHA@  step_000001.json\n", "names other files"),
        ("bad_hex", f"{'z' * 64}  {b}\n@COMP_SHA@  {c}\n", "malformed commit marker"),
        ("short_hex", f"{'a' * 63}  {b}\n@COMP_SHA@  {c}\n", "malformed commit marker"),
        ("uppercase_hex", f"@BIN_SHA_UPPER@  {b}\n@COMP_SHA@  {c}\n", "malformed commit marker"),
        ("empty", "", "malformed commit marker"),
        ("huge", f"@BIN_SHA@  {b}\n@COMP_SHA@  {c}\n" + "#" * 5000, "commit marker is too large"),
        ("wrong_bin_hash", f"{'0' * 64}  {b}\n@COMP_SHA@  {c}\n", "disagree"),
    ):
        put(f"marker_{name}.bin.sha256", text.encode(), "marker", "IntegrityError", match)
    put("marker_binary.bin.sha256", bytes(range(256)) * 2, "marker", "IntegrityError", "malformed commit marker")

    # ---- companions (for step_000002) -------------------------------------------------------------
    env = {"format": "ripresa.companion", "format_version": 1,
           "bin": {"name": b, "sha256": "@BIN_SHA@", "size": "@BIN_SIZE@", "step": 2, "n_params": "@N@"},
           "state": {"progress": {"step": 2}}}

    def comp(**changes) -> bytes:
        doc = json.loads(json.dumps(env))
        for path, value in changes.items():
            node = doc
            keys = path.split("__")
            for k in keys[:-1]:
                node = node[k]
            if value is _DROP:
                del node[keys[-1]]
            else:
                node[keys[-1]] = value
        return json.dumps(doc).replace('"@BIN_SIZE@"', "@BIN_SIZE@").replace('"@N@"', "@N@").encode()

    tensor = {"__tensor__": "float32", "shape": [2], "data": [1.0, 2.0]}
    for name, data, match in (
        ("not_json", b"{this is not json", "not valid JSON"),
        ("not_utf8", b"\xff\xfe{}", "not valid JSON"),
        ("not_an_object", b"[1, 2, 3]", "not a JSON object"),
        ("wrong_format", comp(format="evil"), "not a ripresa companion"),
        ("wrong_version", comp(format_version=99), "unsupported companion version"),
        ("missing_bin", comp(bin=_DROP), "lacks its 'bin' record"),
        ("bin_name_dotdot", comp(bin__name="../step_000002.bin"), "invalid .bin file"),
        ("bin_name_absolute", comp(bin__name="/etc/passwd"), "invalid .bin file"),
        ("bin_name_other", comp(bin__name="step_000001.bin"), "disagree"),
        ("bin_sha_uppercase", comp(bin__sha256="A" * 64), "malformed"),
        ("bin_sha_short", comp(bin__sha256="a" * 10), "malformed"),
        ("bin_size_string", comp(bin__size="12"), "not a non-negative integer"),
        ("bin_size_negative", comp(bin__size=-5), "not a non-negative integer"),
        ("bin_step_bool", comp(bin__step=True), "not a non-negative integer"),
        ("bin_step_other", comp(bin__step=1), "disagree"),
        ("bin_size_vs_n_params", comp(bin__n_params=3), "disagrees with its n_params"),
        ("missing_state", comp(state=_DROP), "lacks 'state'"),
        ("state_not_object", comp(state=[1, 2]), "lacks 'state'"),
        ("deep_nesting", comp().replace(b'"state": {', b'"state": {"deep": ' + b"[" * 3000 + b"]" * 3000 + b", "),
         "malformed"),
        ("tensor_bad_dtype", comp(state__t=dict(tensor, __tensor__="complex128")), "malformed tensor"),
        ("tensor_negative_shape", comp(state__t=dict(tensor, shape=[-2])), "bad tensor shape"),
        ("tensor_huge_shape", comp(state__t=dict(tensor, shape=[2**40, 2**40])), "beyond any size"),
        # zero bytes, so no length check bounds the other dimensions: the one shape bound does (issue #29)
        ("tensor_zero_byte_huge_shape", comp(state__t=dict(tensor, shape=[0, 2**64], data=[])), "beyond any size"),
        ("tensor_zero_byte_strides", comp(state__t=dict(tensor, shape=[0, 2**16, 2**16, 2**16, 2**16], data=[])),
         "beyond any size"),
        ("tensor_data_length", comp(state__t=dict(tensor, data=[1.0])), "does not match its shape"),
        ("tensor_string_data", comp(state__t=dict(tensor, data=["a", "b"])), "malformed"),
        ("dict_tag_not_a_list", comp(state__t={"__dict__": 5}), "malformed"),
        ("dict_tag_bad_pairs", comp(state__t={"__dict__": [[1]]}), "malformed"),
        ("tuple_tag_not_a_list", comp(state__t={"__tuple__": 5}), "malformed"),
    ):
        put(f"companion_{name}.json", data, "companion", "IntegrityError", match)
    (OUT / "manifest.json").write_text(json.dumps(cases, indent=1) + "\n")
    return cases


class _Drop:
    pass


_DROP = _Drop()


if __name__ == "__main__":
    torch.manual_seed(0)
    out = build()
    total = sum((OUT / c["name"]).stat().st_size for c in out if (OUT / c["name"]).exists())
    print(f"wrote {len(out)} cases ({total} bytes) into {OUT}")
