"""`strata export` of steps saved with client.save(), to a plain DCP directory, a torch.save file and
safetensors: nested dicts and lists, an optimizer's state and the RNG states come back, tensors bit
for bit; ranks that saved the same (replicated) state merge into one output, others give one per
rank; lossy tensors are named. The fast tests run the two halves in this process; the slow ones run
the CLI and load each export in a process that cannot import Strata."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from statecheck import assert_bitwise_equal

from sidecar import cli
from sidecar import manifest as mf
from trainer_client import export as ex
from trainer_client.export import flatten

# Loads every export named on the command line as a user without Strata would, and torch.save's
# what it got (a dict per export) to the last argument.
LOAD_WITHOUT_STRATA = """
import sys

class NoStrata:  # importing Strata fails here: the exports must not need it
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trainer_client", "sidecar"):
            raise ImportError(f"{name} must not be needed to load an export")
        return None

sys.meta_path.insert(0, NoStrata())
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

got = {}
for arg in sys.argv[1:-1]:
    fmt, path = arg.split("=", 1)
    if fmt == "dcp":
        md = FileSystemReader(path).read_metadata()
        state = {
            k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in md.state_dict_metadata.items()
        }
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    elif fmt == "torch":
        state = torch.load(path, weights_only=True)
    elif fmt == "torch-full":  # what holds numpy arrays (numpy's RNG state) needs full pickle
        state = torch.load(path, weights_only=False)
    else:
        state = load_file(path)
    got[arg] = state
torch.save(got, sys.argv[-1])
"""


def load_without_strata(tmp: Path, cwd: Path, **exports: Path) -> dict[str, Any]:
    args = [f"{fmt.replace('_', '-')}={path}" for fmt, path in exports.items()]
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_STRATA, *args, str(tmp / "loaded.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,  # not the repository: nothing of it on sys.path
    )
    assert done.returncode == 0, done.stderr
    got = torch.load(tmp / "loaded.pt", weights_only=False)
    return {fmt: got[arg] for fmt, arg in zip(exports, args, strict=True)}


def export(server: Any, job: str, fmt: str, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    store = ["--storage", server.settings.storage, "--job", job]
    assert cli.main(["export", *store, "--format", fmt, "--out", str(out)]) == 0
    return capsys.readouterr().out


def trained() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "extra": {"ema": [torch.randn(5, dtype=torch.bfloat16), {"count": 7}], "tag": "run-a"},
        "epoch": 3,
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Tensors bitwise, plain values equal, under the same dotted names."""
    got, want = dict(flatten(got)), dict(flatten(want))
    assert got.keys() == want.keys()
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert_bitwise_equal({k: got[k] for k in tensors}, {k: want[k] for k in tensors})
    assert {k: got[k] for k in want if k not in tensors} == {
        k: v for k, v in want.items() if k not in tensors
    }


def in_process(server: Any, job: str, fmt: str, out: Path, staging: Path) -> list[str]:
    """Both halves of `strata export` in this process (the CLI runs the second in a subprocess)."""
    staging.mkdir()
    cli.stage_export(
        server.store,
        mf.read_commit(server.store, "default", job, mf.committed_steps(server.store, "default", job)[-1]),
        staging,
    )
    return ex.export(staging, out, fmt)


def test_every_format_holds_what_client_save_saved(make_sidecar, make_client, job_name, tmp_path):
    server = make_sidecar()
    state = trained()
    make_client(server, job_name).save(5, state).durable.result(30)
    rng_torch = torch.get_rng_state()
    said = in_process(server, job_name, "torch", tmp_path / "pt", tmp_path / "s1")
    assert said[0] == "one state"  # numpy's RNG state: a torch.load with weights_only=False, said so
    assert said[1].startswith(
        f"{tmp_path / 'pt' / 'state.pt'}: torch.load(path, weights_only=False) (it holds numpy"
    )
    whole = torch.load(tmp_path / "pt" / "state.pt", weights_only=False)
    rng = whole.pop("__strata_rng__")
    same(whole, state)
    assert torch.equal(rng["torch"], rng_torch)
    said = in_process(server, job_name, "dcp", tmp_path / "dcp", tmp_path / "s2")
    assert said[1].startswith(f"{tmp_path / 'dcp'}: torch.distributed.checkpoint.load(")
    assert (tmp_path / "dcp" / ".metadata").is_file()
    with pytest.raises(
        ex.ExportError, match=r"^--format safetensors holds tensors only; not tensors: epoch, "
    ):
        in_process(server, job_name, "safetensors", tmp_path / "st", tmp_path / "s3")


def test_lossy_and_replicated_are_said(make_sidecar, make_client, job_name, tmp_path):
    server = make_sidecar(quantize="4", quantize_match="table", encode_workers=1)
    saved = {"table": torch.randn(256, 8), "dense": torch.randn(16)}
    clients = [make_client(server, job_name, rank=r, world_size=2, generation="dp/0") for r in range(2)]
    for client in clients:
        client.replicate(saved["dense"], group=[0, 1])
    for h in [c.save(5, {"table": saved["table"], "dense": saved["dense"]}) for c in clients]:
        h.durable.result(30)
    said = in_process(server, job_name, "safetensors", tmp_path / "st", tmp_path / "s")
    assert (
        said[0] == "2 ranks saved different states: one output per rank (rank-<r>)"
    )  # the tables are theirs
    assert said[-1].startswith("1 tensors were stored lossy and are exported as restored from storage")
    from safetensors.torch import load_file

    for r in range(2):
        got = load_file(tmp_path / "st" / f"rank-{r}.safetensors")
        assert torch.equal(got["dense"], saved["dense"])  # replicated: from its owner's snapshot, bitwise
        assert not torch.equal(got["table"], saved["table"])


def test_a_client_save_exports_to_every_format_and_loads_without_strata(
    make_sidecar, make_client, job_name, tmp_path, short_tmp, capsys
):
    server = make_sidecar()
    state = trained()
    client = make_client(server, job_name)  # RNG states captured, as by default
    client.save(5, state).durable.result(30)
    rng_torch = torch.get_rng_state()

    said = export(server, job_name, "dcp", tmp_path / "dcp", capsys)
    assert "one state" in said and "torch.distributed.checkpoint.load" in said
    said = export(server, job_name, "torch", tmp_path / "pt", capsys)
    assert f"{tmp_path / 'pt' / 'state.pt'}: torch.load(path, weights_only=False)" in said  # numpy's RNG
    # a state with more than tensors: one line naming the keys, and the fix
    with pytest.raises(SystemExit) as refused:
        cli.main(
            [
                "export",
                "--storage",
                server.settings.storage,
                "--job",
                job_name,
                "--format",
                "safetensors",
                "--out",
                str(tmp_path / "st"),
            ]
        )
    message = str(refused.value)
    assert message == (
        "strata export: --format safetensors holds tensors only; not tensors: epoch, extra.ema.1, extra.tag, "
        "optim.param_groups. Use --format torch"
    )
    # tensors only: safetensors, the RNG states the client captured left out (and said so)
    tensors_only = {"model": state["model"], "ema": state["extra"]["ema"][:1]}
    make_client(server, job_name + "-t").save(1, tensors_only).durable.result(30)
    said = export(server, job_name + "-t", "safetensors", tmp_path / "st", capsys)
    assert "left out: the RNG states (__strata_rng__)" in said

    got = load_without_strata(
        tmp_path,
        short_tmp,
        dcp=tmp_path / "dcp",
        torch_full=tmp_path / "pt" / "state.pt",
        safetensors=tmp_path / "st" / "state.safetensors",
    )
    whole = got["torch_full"]
    rng = whole.pop("__strata_rng__")
    same(whole, state)
    assert torch.equal(rng["torch"], rng_torch)  # the RNG states as they were at the save
    assert isinstance(rng["python"], tuple) and rng["numpy"][0] == "MT19937"
    dcp_state = {k: v for k, v in got["dcp"].items() if not k.startswith("__strata_rng__.")}
    same(dcp_state, dict(flatten(state)))
    same(got["safetensors"], dict(flatten(tensors_only)))


@pytest.mark.slow
def test_ranks_merge_when_replicated_else_one_output_per_rank(
    make_sidecar, make_client, job_name, tmp_path, short_tmp, capsys
):
    server = make_sidecar()
    torch.manual_seed(1)
    model = torch.nn.Linear(6, 6)
    for job, private in ((job_name, False), (job_name + "-own", True)):
        clients = [make_client(server, job, rank=r, world_size=2, generation="dp/0") for r in range(2)]
        states: list[dict[str, Any]] = [{"model": model} for _ in range(2)]
        if private:
            for r, s in enumerate(states):
                s["mine"] = torch.full((3,), float(r))
        for client, s in zip(clients, states, strict=True):
            client.replicate(s["model"], group=[0, 1])
        for h in [c.save(2, s) for c, s in zip(clients, states, strict=True)]:
            h.durable.result(30)

    said = export(server, job_name, "torch", tmp_path / "merged", capsys)
    assert "2 ranks saved the same state (replicated): merged into one" in said
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["state.pt"]
    said = export(server, job_name + "-own", "dcp", tmp_path / "per-rank", capsys)
    assert "2 ranks saved different states: one output per rank" in said
    assert sorted(p.name for p in (tmp_path / "per-rank").iterdir()) == ["rank-0", "rank-1"]

    got = load_without_strata(
        tmp_path,
        short_tmp,
        torch_full=tmp_path / "merged" / "state.pt",
        dcp=tmp_path / "per-rank" / "rank-1",
    )
    # rank 0 stored some of the model, rank 1 the rest: the merged state holds all of it
    same({"model": got["torch_full"]["model"]}, {"model": model.state_dict()})
    assert torch.equal(got["dcp"]["mine"], torch.full((3,), 1.0))
    same(
        {k: v for k, v in got["dcp"].items() if k.startswith("model.")},
        dict(flatten({"model": model.state_dict()})),
    )


@pytest.mark.slow
def test_lossy_tensors_are_exported_as_stored_and_named(
    make_sidecar, make_client, job_name, tmp_path, short_tmp, capsys
):
    server = make_sidecar(quantize="4", quantize_match="table", encode_workers=1)
    saved = {"table": torch.randn(256, 8), "dense": torch.randn(16)}
    make_client(server, job_name, capture_rng=False).save(5, saved).durable.result(30)
    said = export(server, job_name, "safetensors", tmp_path / "st", capsys)
    assert (
        "1 tensors were stored lossy and are exported as restored from storage, not as trained: table (4 bits"
        in said
    )
    got = load_without_strata(tmp_path, short_tmp, safetensors=tmp_path / "st" / "state.safetensors")[
        "safetensors"
    ]
    assert torch.equal(got["dense"], saved["dense"])  # lossless: bit for bit
    assert not torch.equal(got["table"], saved["table"])  # the 4-bit form
    assert (got["table"] - saved["table"]).norm() < 0.2 * saved["table"].norm()


def test_a_python_without_safetensors_is_told_which_extra_to_install() -> None:
    missing = subprocess.CompletedProcess(
        [], 1, "", "Traceback...\nModuleNotFoundError: No module named 'safetensors'\n"
    )
    with pytest.raises(SystemExit, match=r"pip install -e '<this repository>\[export\]' there, or pass"):
        cli._torch_half_done(missing, "export", "writing", "/usr/bin/python3")
