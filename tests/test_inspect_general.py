"""`ripresa inspect FILE.safetensors` (docs/INSPECT.md): a general generation's header, companion and named checks;
a foreign safetensors file shown as such; hostile files give a typed error, exit 1 or 2, no traceback, no hang."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest
import torch

import ripresa
from ripresa.cli import main as cli_main
from ripresa.io import auth

KEY = b"a-test-key-that-is-long-enough-32b"


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def _run(folder, steps: int = 2):
    torch.manual_seed(0)
    model = Tied()
    state = ripresa.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with ripresa.Checkpointer(folder, state, every=1, asynchronous=False, handle_signals=False) as ck:
        for step in range(ck.resume() + 1, steps + 1):
            state.optimizer.zero_grad()
            model.head(model.emb(torch.randint(0, 8, (4,)))).sum().backward()
            state.optimizer.step()
            ck.step_done(step)
    return folder / f"step_{steps:06d}.safetensors"


def _inspect(capsys, *args):
    code = cli_main(["inspect", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, json.loads(out)


def test_a_general_generation_shows_header_companion_and_named_checks(tmp_path, capsys):
    f = _run(tmp_path / "run")
    code, r = _inspect(capsys, f)
    s = r["safetensors"]
    assert code == 0 and r["kind"] == "safetensors" and s["generation"] and s["valid"] and s["step"] == 2
    assert [c["name"] for c in s["checks"]] == ["marker present", "marker format", "tensor header", "tensor step",
                                                "companion sha256", "companion schema", "companion record",
                                                "tensor sha256", "companion state"]
    assert {"model", "optimizer", "rng"} <= set(s["header"]["groups"]) and s["header"]["dtypes"]["F32"] >= 2
    assert s["aliases"] == {"model/head.weight": "model/emb.weight"}
    assert s["companion"]["record"]["step"] == 2 and s["companion"]["progress"]["step"] == 2
    assert len(s["sha256"]) == 64
    assert cli_main(["inspect", str(f)]) == 0  # the tables render
    assert "general generation" in capsys.readouterr().out
    # a flipped byte in a tensor: the named check that fails says so, exit 1
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 1
    f.write_bytes(bytes(raw))
    code, r = _inspect(capsys, f)
    assert code == 1 and not r["safetensors"]["valid"] and r["safetensors"]["checks"][-1]["name"] == "tensor sha256"
    code, r = _inspect(capsys, f, "--no-deep")  # only headers, sizes, marker and companion: not noticed
    assert code == 0 and r["safetensors"]["checks"][-1]["name"] == "companion record"


def test_a_foreign_safetensors_file_is_shown_as_such(tmp_path, capsys):
    from safetensors.torch import save_file

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}, str(f), metadata={"who": "else"})
    code, r = _inspect(capsys, f)
    s = r["safetensors"]
    assert code == 0 and not s["generation"] and s["header"]["tensors"] == 2 and s["header"]["metadata"] == {"who": "else"}
    assert s["header"]["dtypes"] == {"BF16": 1, "F32": 1} and len(s["sha256"]) == 64
    assert any("foreign safetensors file" in w for w in r["warnings"])


@pytest.mark.parametrize("case", ["huge_length", "not_json", "range_past_end", "empty"])
def test_a_crafted_header_is_a_typed_error_exit_1(tmp_path, capsys, case):
    f = tmp_path / "step_000002.safetensors"
    if case == "huge_length":
        f.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    elif case == "not_json":
        f.write_bytes(struct.pack("<Q", 8) + b"{not js}")
    elif case == "range_past_end":
        head = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}).encode()
        head += b" " * (-len(head) % 8)
        f.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 16)
    else:
        f.write_bytes(b"")
    code, r = _inspect(capsys, f)
    assert code == 1 and r["error"]["error"] == "IntegrityError" and r["problems"]


def test_a_symlink_or_a_fifo_is_refused_without_hanging(tmp_path, capsys):
    f = _run(tmp_path / "run", 1)
    link = tmp_path / "link.safetensors"
    os.symlink(f, link)
    code, r = _inspect(capsys, link)
    assert code in (1, 2) and r["problems"]
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.setdefault("code", cli_main(["inspect", str(fifo)])), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and result["code"] == 2
    assert "special file" in capsys.readouterr().err


def test_require_signature_accepts_a_signed_general_generation(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    signed = _run(tmp_path / "signed")
    assert signed.with_name(signed.name + ".hmac").is_file()
    monkeypatch.delenv(auth.ENV_KEY)
    unsigned = _run(tmp_path / "unsigned")
    monkeypatch.setenv(auth.ENV_REQUIRE, "0")  # restored after the test (the CLI sets it)
    assert cli_main(["inspect", str(signed), "--require-signature"]) == 2  # no key
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    assert cli_main(["inspect", str(signed), "--require-signature"]) == 0
    assert cli_main(["inspect", str(unsigned), "--require-signature"]) == 1
    err = capsys.readouterr().err
    assert "not trusted under --require-signature" in err and "Traceback" not in err
