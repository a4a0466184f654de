"""``nebula-ckpt export --to``: a target inside the root it reads, or a broken link, is refused first.

An export written into the checkpoint root (a shard's own path, the root as a folder, through a
symlink, a ``..`` path or a relative path from inside the root, the memory tier's folder) would
overwrite or add files of committed checkpoints: it is refused before anything is read, and the
root is left exactly as it was. A ``--to`` that is a dangling symlink or a link loop is named as
such, before the checkpoint is read (never "File exists" after reading it all, never the link
silently replaced).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
import warm_python
from memory_paths import memory_tier_path
from nebula_ckpt.cli import main


def _tree(path: str) -> dict[str, str]:
    """Every file under ``path`` (links not followed) -> a digest of its bytes."""
    out = {}
    for dp, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def saved(root: str) -> str:
    with nc.Checkpointer(root) as ck:
        ck.save(1, {"w": torch.arange(1000.0), "step": 1})
        ck.save(2, {"w": torch.arange(1000.0) + 2, "step": 2})
    return root


def _shard(root: str) -> str:
    return next(f"{root}/step-2/{n}" for n in os.listdir(f"{root}/step-2") if n.startswith("shard-"))


def _memory_folder(root: str) -> str:
    return memory_tier_path(root)


TARGETS: dict[str, Callable[[str, Any], str]] = {
    "a shard's own path": lambda root, tmp: _shard(root),
    "the root as a folder": lambda root, tmp: root + "/",
    "a new file in a step folder": lambda root, tmp: f"{root}/step-2/model.safetensors",
    "a new folder below the root": lambda root, tmp: f"{root}/exports/",
    "a path with ..": lambda root, tmp: f"{tmp}/elsewhere/../{os.path.basename(root)}/step-2/x.pt",
    "a symlink to the root": lambda root, tmp: _link(root, f"{tmp}/link") + "/step-2/x.pt",
    "a symlink to a shard": lambda root, tmp: _link(_shard(root), f"{tmp}/out.safetensors"),
    "a relative path from inside the root": lambda root, tmp: _chdir(f"{root}/step-2", "x.safetensors"),
    "the memory tier's folder": lambda root, tmp: _memory_folder(root) + "/step-2/x.pt",
}


def _link(target: str, path: str) -> str:
    os.symlink(target, path)
    return path


def _chdir(folder: str, rel: str) -> str:
    os.chdir(folder)
    return rel


@pytest.mark.parametrize("how", list(TARGETS))
def test_export_into_the_root_it_reads_is_refused_before_anything_is_read(saved: str, tmp_path, how: str,  # noqa: ANN001
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a target may chdir; the test's cwd comes back
    os.makedirs(tmp_path / "elsewhere", exist_ok=True)
    memory = _memory_folder(saved)
    before, mem_before = _tree(saved), _tree(memory)
    to = TARGETS[how](saved, str(tmp_path))
    capsys.readouterr()
    assert main(["export", saved, "--to", to]) == 1
    err = capsys.readouterr().err
    assert "inside" in err and "--to" in err, err
    assert _tree(saved) == before and _tree(memory) == mem_before, "the export wrote into the root"
    assert main(["verify", saved]) == 0


def test_a_bind_mount_of_the_root_is_refused_too(saved: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    other = tmp_path / "mounted"
    other.mkdir()
    if warm_python.run(["mount", "--bind", saved, str(other)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts need root (CAP_SYS_ADMIN)")
    try:
        before = _tree(saved)
        assert main(["export", saved, "--to", f"{other}/step-2/x.pt"]) == 1
        assert "inside" in capsys.readouterr().err
        assert _tree(saved) == before
    finally:
        warm_python.run(["umount", str(other)], check=True)


def test_export_beside_the_root_is_fine(saved: str, tmp_path) -> None:  # noqa: ANN001
    """A sibling whose name starts like the root's is not inside it."""
    to = f"{saved}-exports/step.pt"
    assert main(["export", saved, "--to", to]) == 0
    assert torch.equal(torch.load(to)["w"], torch.arange(1000.0) + 2)


@pytest.mark.parametrize("slash", ["", "/"])
@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_to_at_a_dangling_link_or_a_loop_says_so_first(saved: str, tmp_path, kind: str, slash: str,  # noqa: ANN001
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    link = str(tmp_path / "out")
    os.symlink(str(tmp_path / "nowhere" / "model.pt") if kind == "dangling" else link, link)
    for sh in os.listdir(f"{saved}/step-2"):  # a checkpoint that cannot be read: the link must be named first
        if sh.startswith("shard-"):
            with open(f"{saved}/step-2/{sh}", "r+b") as f:
                f.truncate(100)
    assert main(["export", saved, "--step", "2", "--to", link + slash]) == 1
    err = capsys.readouterr().err
    assert ("dangling" if kind == "dangling" else "loop") in err and link in err, err
    assert "File exists" not in err and "truncated" not in err, err
    assert os.path.islink(link), "the link was replaced"
