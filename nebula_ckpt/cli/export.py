"""``nebula-ckpt export``: one verified checkpoint as a single ``torch.save`` or safetensors file.

A multi-rank checkpoint is gathered into full, unsharded tensors. ``--key K`` exports only what
the state held under ``K`` (a module saved as ``{"model": model, ...}``: ``--key model``), each
tensor named by its key below ``K``: for a module, its own ``state_dict()`` keys, so
``transformers``' ``from_pretrained`` loads the file (safetensors metadata ``format: pt``
included). Tied weights are written as separate copies under each name in safetensors, tied in
a ``.pt``. When the checkpoint holds a Hugging Face config beside ``K`` (the Hugging Face
integration saves it as ``config``), ``config.json`` is written next to the file; when it holds
none, the command says so.

``--to`` names a file, or a folder (one that exists, or a path ending in ``/``): then the file in
it is ``model.safetensors`` / ``pytorch_model.bin`` with ``--key`` (the names ``from_pretrained``
looks for), ``step-<N>.safetensors`` / ``step-<N>.pt`` without. Missing folders are created once
the checkpoint is verified; the file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from nebula_ckpt.cli.choose import add_choice_arguments, open_chosen
from nebula_ckpt.cli.common import note, open_any, out, progress, ranks_text
from nebula_ckpt.cli.export_values import is_hugging_face, shown, values_left_out, weights_only
from nebula_ckpt.errors import NebulaError
from nebula_ckpt.format import manifest as mf
from nebula_ckpt.format.tree import decode
from nebula_ckpt.restore.apply import materialize
from nebula_ckpt.restore.open import OpenCheckpoint, read_manifest
from nebula_ckpt.restore.walk import tensor_keys
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import local_path
from nebula_ckpt.tiers.roots import default_tiers

#: file names in a ``--to`` folder with ``--key`` (what ``from_pretrained`` looks for), by format
PRETRAINED_NAMES = {"safetensors": "model.safetensors", "torch": "pytorch_model.bin"}
CONFIG_NAME = "config.json"


@dataclass
class Source:
    """What one export reads: a verified one-process checkpoint (``ck``), or a multi-rank one
    gathered whole (``full``: every tensor by key)."""

    step: int
    man: mf.Manifest
    ck: Optional[OpenCheckpoint] = None
    full: Optional[dict[str, Any]] = None

    @property
    def tree(self) -> Mapping[str, Any]:
        """The saved state's typed tree (of a multi-rank checkpoint: every rank's merged, so what
        only some ranks hold is in it; a value several ranks hold is the lowest rank's)."""
        if self.ck is not None:
            return self.ck.tree
        return self.man.job_tree()


def open_source(st: Storage, step: int, where: str) -> Source:
    """Open and fully verify ``step`` for export (gathering a multi-rank checkpoint)."""
    from nebula_ckpt.restore.reshard import gather_full

    man = read_manifest(st, step, where)
    if not man.multi_rank:
        ck = open_any(st, step, "full", where)   # referenced bytes of earlier steps too
        return Source(ck.step, ck.manifest, ck=ck)
    if len(man.ranks) != man.world_size:
        raise NebulaError(f"{where}: holds only {ranks_text(man)} (a rank's memory tier); export needs every "
                          "rank's shard")
    return Source(man.step, man, full=gather_full(st, step, man, verify=True))


def subtree(tree: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The node of ``tree`` at the saved key path ``key`` (``"model"``, ``"state/model"``):
    through dict keys (as text) and list indices, looking through stateful objects."""
    node = tree
    walked: list[str] = []
    for part in key.split("/"):
        while node["t"] == "stateful":
            node = node["state"]
        found: Optional[Mapping[str, Any]] = None
        if node["t"] in ("dict", "odict"):
            found = next((v for k, v in node["v"] if str(k["v"]) == part), None)
        elif node["t"] in ("list", "tuple") and part.isdigit() and int(part) < len(node["v"]):
            found = node["v"][int(part)]
        if found is None:
            here = "/".join(walked) or "the top level"
            keys = [str(k["v"]) for k, _ in node["v"]][:20] if node["t"] in ("dict", "odict") else []
            raise NebulaError(f"export: --key {key!r}: the checkpoint has no key {part!r} at {here}"
                              + (f" (keys there: {keys})" if keys else f" (a {node['t']} is there)"))
        walked.append(part)
        node = found
    return node


def owned_copy(v: Any) -> Any:
    """An owned CPU copy of a tensor view over shard bytes (byte copy: any dtype)."""
    import torch

    return v.reshape(-1).view(torch.uint8).clone().view(v.dtype).reshape(v.shape)


def _shared_copies(src: Source) -> Callable[[str], Any]:
    """Key -> an owned tensor, one copy per stored tensor (tied keys share it)."""
    owned: dict[str, Any] = {}

    def tensor(k: str) -> Any:
        if src.full is not None:
            return src.full[k]
        assert src.ck is not None
        real = src.ck.resolve(k).key
        if real not in owned:
            owned[real] = owned_copy(src.ck.view(k))
        return owned[real]
    return tensor


@functools.lru_cache(maxsize=None)
def safetensors_holds(dtype: Any) -> bool:
    """Whether the installed safetensors writes tensors of ``dtype`` (its dtype table grows with
    its version: complex128, complex32, the bits and sub-byte dtypes have no code in it)."""
    import torch
    from safetensors.torch import save

    try:
        with warnings.catch_warnings():  # complex32: "ComplexHalf support is experimental"
            warnings.simplefilter("ignore")
            save({"probe": torch.empty(1, dtype=dtype)})
    except (KeyError, ValueError, TypeError, RuntimeError):
        return False
    return True


#: the sub-byte shell dtypes, which torch.save cannot write (its pickler has no storage type for them)
SUB_BYTE_DTYPES = frozenset(f"{u}int{bits}" for u in ("", "u") for bits in range(1, 8))


def _dtypes(src: Source, keys: list[str]) -> dict[str, Any]:
    """The torch dtype of each tensor ``keys`` of ``src``, from its manifest (nothing is read)."""
    if src.full is not None:
        return {k: src.full[k].dtype for k in keys}
    assert src.ck is not None
    return {k: src.ck.resolve(k).torch_dtype for k in keys}


def _named(bad: list[tuple[str, Any]]) -> str:
    return ", ".join(f"'{k}' ({str(d).removeprefix('torch.')})" for k, d in bad[:5]) + (" ..." if len(bad) > 5 else "")


def check_safetensors_dtypes(src: Source, keys: list[str]) -> None:
    """Refuse, before anything is copied or written, a safetensors export of tensors (``keys`` of
    ``src``) whose dtype safetensors has no code for, naming them and the fix."""
    bad = [(k, d) for k, d in _dtypes(src, keys).items() if not safetensors_holds(d)]
    if not bad:
        return
    sub = [(k, d) for k, d in bad if str(d).removeprefix("torch.") in SUB_BYTE_DTYPES]
    fix = ("export a torch.save file instead, which keeps every other dtype: --format torch with a --to ending in "
           ".pt (or a folder)") if not sub else \
        (f"torch.save cannot write the sub-byte dtypes ({_named(sub)}) either: read the step in Python "
         f"(nebula_ckpt.Checkpointer(root).read({src.step})), or export a --key that holds none of them")
    raise NebulaError(f"export: safetensors has no dtype for {len(bad)} tensor(s) of step {src.step}: "
                      f"{_named(bad)}; {fix}")


def _tensor_keys(src: Source, node: Mapping[str, Any], key: Optional[str]) -> list[str]:
    """The keys of the tensors an export of ``key`` (None: the whole state) writes."""
    if key is not None:
        return tensor_keys(node, [])
    return list(src.full) if src.full is not None else list(src.ck.keys()) if src.ck is not None else []


def check_torch_dtypes(src: Source, keys: list[str]) -> None:
    """Refuse, before the state is materialized or anything written, a torch.save export of sub-byte
    tensors (``keys`` of ``src``): torch.save cannot write them."""
    bad = [(k, d) for k, d in _dtypes(src, keys).items() if str(d).removeprefix("torch.") in SUB_BYTE_DTYPES]
    if bad:
        raise NebulaError(f"export: torch.save cannot write the sub-byte dtypes of {len(bad)} tensor(s) of step "
                          f"{src.step}: {_named(bad)}, and safetensors has no code for them either; read the step "
                          f"in Python (nebula_ckpt.Checkpointer(root).read({src.step})), or export a --key that "
                          "holds none of them")


def safetensors_payload(src: Source, node: Mapping[str, Any], key: Optional[str],
                        quiet: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors and metadata of a safetensors export (tied tensors as separate copies:
    safetensors refuses shared memory); a dtype safetensors lacks is refused first."""
    meta = {"format": "pt", "nebula_step": str(src.step)}
    if key is None:
        if src.full is not None:
            check_safetensors_dtypes(src, list(src.full))
            meta.update(nebula_aliases="{}", nebula_world_size=str(src.man.world_size))
            return src.full, meta
        assert src.ck is not None
        check_safetensors_dtypes(src, list(src.ck.keys()))
        meta["nebula_aliases"] = json.dumps(dict(src.man.aliases))
        return {k: owned_copy(src.ck.view(k)) for k in progress(list(src.ck.keys()), "export", "tensor", quiet)}, meta
    prefix = key + "/"
    keys = tensor_keys(node, [])
    if not keys or any(not k.startswith(prefix) for k in keys):
        raise NebulaError(f"export: --key {key!r} holds {'no tensors' if not keys else 'a tensor itself'}; "
                          "name the dict or module whose tensors to export (e.g. --key model)")
    check_safetensors_dtypes(src, keys)
    tensor = _shared_copies(src)
    tensors, seen = {}, set()
    for k in progress(keys, "export", "tensor", quiet):
        t = tensor(k)
        tensors[k[len(prefix):]] = t.clone() if id(t) in seen or src.full is not None else t
        seen.add(id(t))
    meta["nebula_key"] = key
    return tensors, meta


def torch_payload(src: Source, node: Mapping[str, Any], key: Optional[str], allow_pickle: bool) -> Any:
    """The state a ``torch.save`` export writes (tied tensors stay tied)."""
    if src.full is not None:
        return decode(node, src.full.__getitem__, allow_pickle)
    assert src.ck is not None
    if key is None:
        return materialize(src.ck, map_location="cpu", allow_pickle=allow_pickle)
    return decode(node, _shared_copies(src), allow_pickle, key)


def folder_named(to: str) -> bool:
    """Whether ``--to`` names a folder (one that exists, or a path ending in a separator)."""
    return to.endswith(("/", os.sep)) or os.path.isdir(to)


def check_target(to: str, root: str, storage_options: Optional[dict[str, Any]]) -> None:
    """Refuse a ``--to`` that cannot be written safely, before anything is read: a dangling link
    or a link loop on its way, a file where a folder must be, or a place inside a folder this
    command reads (the root, its memory tier: an export there would overwrite or add files of
    committed checkpoints), however it is spelled (a symlink into it, ``..``, a relative path, a
    bind mount of it)."""
    _check_links(to)
    folder = to if folder_named(to) else os.path.dirname(os.path.abspath(to))
    check_folder(folder)
    for read in read_folders(root, storage_options):
        for path in (to, folder):
            if _inside(path, read):
                raise NebulaError(f"export: --to {to} is inside {read}, which this command reads (the checkpoint "
                                  "root or its memory tier): writing there would change committed checkpoints. "
                                  "Export to a folder outside it")


def read_folders(root: str, storage_options: Optional[dict[str, Any]]) -> list[str]:
    """The local folders the export of ``root`` reads: a local root, and its memory tier."""
    out = []
    for t in default_tiers(root, storage_options):
        p = getattr(t, "path", None) or local_path(getattr(t, "url", "") or "")
        if p:
            out.append(os.path.abspath(p))
    return out


def _check_links(to: str) -> None:
    """A symlink on the way to ``to`` that leads nowhere: named, with what it points to."""
    path = os.path.abspath(to.rstrip("/" + os.sep) or to)
    while True:
        if os.path.islink(path):
            try:
                os.stat(path)
            except FileNotFoundError:
                raise NebulaError(f"export: --to: {path} is a dangling symbolic link (to {os.readlink(path)}, which "
                                  "does not exist): remove the link, or create what it points to") from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise NebulaError(f"export: --to: {path} is a symbolic link loop (it leads back to itself): "
                                      "remove the link, or export elsewhere") from None
                raise
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` (existing or not) is ``folder`` or below it: by resolved path (links, ``..``)
    and by identity of every existing folder on its way (a bind mount of ``folder``)."""
    want = os.path.realpath(folder)
    probe = os.path.realpath(os.path.abspath(path))
    if probe == want or probe.startswith(want.rstrip(os.sep) + os.sep):
        return True
    try:
        ident = os.stat(folder)
    except OSError:  # not there: nothing of it can be reached another way
        return False
    while True:
        try:
            st = os.stat(probe)
            if (st.st_dev, st.st_ino) == (ident.st_dev, ident.st_ino):
                return True
        except OSError:
            pass
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent


def check_folder(folder: str) -> None:
    """Refuse a ``--to`` folder below a file, before anything is read or written."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise NebulaError(f"export: --to: {probe} is a file, not a folder; name a file in a folder (missing "
                          "folders are created)")


def target(to: str, fmt: Optional[str], key: Optional[str], step: int) -> tuple[str, str]:
    """``(file to write, format)`` for ``--to`` and ``--format``."""
    if not folder_named(to):
        return to, fmt or ("safetensors" if to.endswith(".safetensors") else "torch")
    fmt = fmt or "safetensors"
    suffix = "safetensors" if fmt == "safetensors" else "pt"
    name = PRETRAINED_NAMES[fmt] if key is not None else f"step-{step}.{suffix}"
    return os.path.join(to.rstrip("/" + os.sep) or to, name), fmt


def saved_config(tree: Mapping[str, Any], key: str) -> Optional[str]:
    """The Hugging Face config saved beside ``key`` (the integration's ``config``: the model's
    ``config.json`` text), or None when there is none (or it is no JSON object)."""
    parent = key.rpartition("/")[0]
    try:
        node = subtree(tree, f"{parent}/config" if parent else "config")
    except NebulaError:
        return None
    if node["t"] != "str":
        return None
    try:
        parsed = json.loads(node["v"])
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack: no config
        return None
    return node["v"] if isinstance(parsed, dict) else None


def config_to_write(folder: str, config: str) -> Optional[str]:
    """The path to write ``config`` at, None when the same config is there already.

    Raises:
        NebulaError: a different ``config.json`` is there (never overwritten).
    """
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        return path
    try:
        with open(path, encoding="utf-8") as f:
            same = json.load(f) == json.loads(config)
    except (OSError, ValueError):
        same = False
    if same:
        return None
    raise NebulaError(f"export: {path} exists and differs from the config saved in the checkpoint; it is not "
                      "overwritten: remove it, or export into another folder")


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` next to ``path``, then rename it into place (a failed write leaves ``path`` as it was)."""
    tmp = f"{path}.nebula-export-{os.getpid()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _write_text(text: str) -> Callable[[str], None]:
    def write(p: str) -> None:
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
    return write


def _no_config_warning(step: int, key: str, folder: str) -> str:
    return (f"warning: step {step} holds no Hugging Face config beside {key!r}, so no {CONFIG_NAME} was written; "
            f"from_pretrained needs one next to the weights (without it a default config is built): write it with "
            f"model.config.save_pretrained({folder!r}), or save the config in the checkpoint as the Hugging Face "
            "integration does (state['config'] = model.config.to_json_string())")


def write_safetensors(tensors: dict[str, Any], meta: dict[str, str], path: str) -> None:
    """Write ``tensors`` and ``meta`` as the safetensors file ``path``, its metadata in key order."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=meta)
    sort_metadata(path)


def sort_metadata(path: str) -> None:
    """Rewrite the ``__metadata__`` of the safetensors file ``path`` in key order, in place (same
    length): safetensors writes it in a random order, and an export of the same step must be the
    same bytes every time. A header that would not keep its length is left as it is."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
        head = json.loads(raw)
        meta = head.get("__metadata__")
        if not isinstance(meta, dict):
            return
        head["__metadata__"] = dict(sorted(meta.items()))
        out = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
        stripped = raw.rstrip(b" ")
        if len(out) == len(stripped) and out != stripped:
            f.seek(8)
            f.write(out)


def cmd_export(args: argparse.Namespace) -> int:
    """Write one fully verified checkpoint as a torch.save or safetensors file (see the module)."""
    import torch

    key = None if args.key is None else args.key.strip("/")
    if key == "":
        raise NebulaError("export: --key must name a key of the saved state, e.g. --key model")
    check_target(args.to, args.root, args.storage_options)
    src = open_chosen(args, open_source)
    path, fmt = target(args.to, args.format, key, src.step)
    folder = os.path.dirname(os.path.abspath(path))
    node = src.tree if key is None else subtree(src.tree, key)
    kept: dict[str, list[str]] = {}  # what is said about the values that are not tensors
    if fmt == "safetensors":
        tensors, meta = safetensors_payload(src, node, key, args.json)
        write: Callable[[str], None] = lambda p: write_safetensors(tensors, meta, p)  # noqa: E731
        kept["left_out"] = values_left_out(node, key or "")
    else:
        check_torch_dtypes(src, _tensor_keys(src, node, key))
        state, kept["converted"], kept["pickled"] = weights_only(torch_payload(src, node, key, args.allow_pickle),
                                                                 key or "")
        write = lambda p: torch.save(state, p)  # noqa: E731
    config = saved_config(src.tree, key) if key is not None else None
    config_path = config_to_write(folder, config) if config is not None else None
    os.makedirs(folder, exist_ok=True)
    write_atomically(path, write)
    if config_path is not None and config is not None:
        write_atomically(config_path, _write_text(config))
    info: dict[str, Any] = {"step": src.step, "to": path, "format": fmt, **{k: v for k, v in kept.items() if v}}
    _say_what_is_kept(src.step, path, kept)
    if key is not None:
        info["key"] = key
        info["config"] = os.path.join(folder, CONFIG_NAME) if config is not None else None
        hugging_face = is_hugging_face(node)
        if config is None and (hugging_face or (hugging_face is None and folder_named(args.to))):
            note(_no_config_warning(src.step, key, folder))
    if src.full is not None:
        info["world_size"] = src.man.world_size
    gathered = f", gathered from {ranks_text(src.man)}" if src.full is not None else ""
    out(json.dumps(info) if args.json else f"exported step {src.step} to {path} ({fmt}{gathered})")
    return 0


def _say_what_is_kept(step: int, path: str, kept: dict[str, list[str]]) -> None:
    """Name, on stderr, the values of step ``step`` that ``path`` holds otherwise than saved, or not at all."""
    if kept.get("left_out"):
        left = kept["left_out"]
        note(f"warning: a safetensors file holds tensors only: {len(left)} other value(s) of step {step} are not in "
             f"{path}: {shown(left)} (export to a .pt file to keep them)")
    if kept.get("converted"):
        conv = kept["converted"]
        note(f"{len(conv)} NumPy value(s) are written as torch tensors and Python numbers, so that "
             f"torch.load({path!r}) (weights_only=True) reads the file: {shown(conv)}")
    if kept.get("pickled"):
        pick = kept["pickled"]
        note(f"warning: {len(pick)} value(s) only pickle restores: read the file with torch.load({path!r}, "
             f"weights_only=False), trusted files only: {shown(pick)}")


def add_export_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]",
                      common: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``export`` subcommand and its options."""
    sp = sub.add_parser("export", help="write a step as one torch.save or safetensors file")
    common(sp)
    add_choice_arguments(sp)
    sp.add_argument("--to", required=True, metavar="FILE|FOLDER/",
                    help="output file (.safetensors -> safetensors, else torch.save), or a folder (an existing "
                         "one, or ending in '/'): model.safetensors / pytorch_model.bin in it with --key, "
                         "step-N.safetensors / .pt without; missing folders are created")
    sp.add_argument("--format", choices=["torch", "safetensors"], default=None)
    sp.add_argument("--key", default=None, metavar="KEY",
                    help="export only what the state held under KEY (e.g. 'model'), named by the keys below it: "
                         "a module's own state_dict() keys, as Hugging Face's from_pretrained expects; a Hugging "
                         "Face config saved beside it is written as config.json")
    sp.add_argument("--allow-pickle", action="store_true", help="allow pickled leaves (trusted checkpoints only)")
