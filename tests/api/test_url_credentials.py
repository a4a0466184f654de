"""Credentials in a root URL (``s3://KEY:SECRET@bucket/run``) are refused at every entry point,
before the URL is parsed, logged, shown or written, with a message that says to pass them in
``storage_options``; the secret never appears in an exception (its whole chain), a log line at
DEBUG, or the CLI's output. A user name alone (Azure's ``container@account``) is not a secret.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nebula_ckpt as nc
from nebula_ckpt import knobs
from nebula_ckpt.errors import ValidationError
from nebula_ckpt.storage import urls

KEY_ID = "AKIAIOSFODNN7EXAMPLE"
#: (URL, the secret it carries): the password shapes of a URL's user info
SHAPES = [
    (f"s3://{KEY_ID}:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@bucket/run", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"),
    (f"s3://{KEY_ID}:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@bucket/run",   # '/' in the secret, as AWS has
     "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    (f"s3://{KEY_ID}:Qz7v/Wq@pRtTWO9@bucket/run", "Qz7v/Wq@pRtTWO9"),       # '/' and '@' in the secret
    ("s3://:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY@bucket/run", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"),
    (f"s3://{KEY_ID}:8675/rXUtnFEMIK7MDENG@bucket/run", "8675/rXUtnFEMIK7MDENG"),  # looks like host:port/path
    ("az://account:bm90LWEtcmVhbC1hY2NvdW50LWtleQ==@container/run", "bm90LWEtcmVhbC1hY2NvdW50LWtleQ=="),
    (f"simplecache::s3://{KEY_ID}:wJalrXUtnFEMI/K7MDENG@bucket/run", "wJalrXUtnFEMI/K7MDENG"),
]
IDS = ["key_secret", "slash_in_secret", "slash_and_at_in_secret", "no_user", "digits_then_slash", "az_account_key",
       "chained"]


def _pieces(secret: str) -> list[str]:
    """The secret and every fragment of it a parser could cut out (split at '/', '@', ':')."""
    out = {secret, KEY_ID}
    for sep in "/@:":
        out.update(p for p in secret.split(sep) if len(p) >= 4)
    out.update(p for s in list(out) for p in s.replace("@", "/").split("/") if len(p) >= 4)
    return sorted(out)


def _chain_text(e: BaseException) -> str:
    """str, repr and traceback of ``e`` and of every exception in its chain (cause and context)."""
    parts, seen, todo = [], set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        parts += [str(x), repr(x), "".join(traceback.format_exception(x))]
        parts += [repr(a) for a in x.args]
        todo += [x.__cause__, x.__context__]
    return "\n".join(parts)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Code that gets past the check must fail fast, never reach a real cloud."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    with knobs.override(remote_timeout_s=3.0, remote_retries=1):
        yield


def _entry_points(tmp_path: Path) -> dict[str, Callable[[str], Any]]:
    from nebula_ckpt.cli import main as cli
    from nebula_ckpt.compat import torch_nebula
    from nebula_ckpt.dcp import NebulaStorageReader, NebulaStorageWriter
    from nebula_ckpt.integrations.huggingface import export_pretrained
    from nebula_ckpt.integrations.huggingface.mixin import setup_trainer
    from nebula_ckpt.storage.remote import FsspecStorage

    local = str(tmp_path / "local")
    with nc.Checkpointer(local, memory_tier=False) as ck:
        ck.save(3, {"w": torch.ones(2)})

    def cli_call(*argv: str) -> Callable[[str], Any]:
        def run(url: str) -> Any:
            rc = cli([*[a.format(url=url) for a in argv]])
            if rc == 0:
                raise AssertionError(f"the CLI accepted {argv}")
            return rc
        return run

    def dcp_reset(url: str) -> Any:
        import torch.distributed.checkpoint as dcp

        dcp.load({"w": torch.zeros(2)}, checkpoint_id=url, storage_reader=NebulaStorageReader(local))

    def lightning(url: str) -> Any:
        from nebula_ckpt.integrations.lightning import NebulaCheckpointIO

        io = NebulaCheckpointIO(url)
        return io.checkpointer  # the Checkpointer is made on first use

    return {
        "Checkpointer": lambda url: nc.Checkpointer(url, memory_tier=False,
                                                    storage_options={"endpoint_url": "http://127.0.0.1:9"}),
        "save_async": lambda url: nc.save_async(url, 1, {"w": torch.ones(2)}, memory_tier=False),
        "load_latest": lambda url: nc.load_latest(url, into={"w": torch.zeros(2)}),
        "RemoteTier": lambda url: nc.Checkpointer(local, tiers=[nc.RemoteTier(url)]),
        "FsspecStorage": lambda url: FsspecStorage(url, {"endpoint_url": "http://127.0.0.1:9"}),
        "cli_ls": cli_call("ls", "{url}"),
        "cli_verify_verbose": cli_call("-v", "verify", "{url}"),
        "cli_export": cli_call("export", "{url}", "--step", "3", "--to", str(tmp_path / "x.pt")),
        "NebulaStorageReader": lambda url: NebulaStorageReader(url),
        "NebulaStorageReader_step_id": lambda url: NebulaStorageReader(f"{url}/step-4", 3),
        "dcp_load_checkpoint_id": dcp_reset,
        "NebulaStorageWriter": lambda url: NebulaStorageWriter(url, step=1),
        "NebulaStorageWriter_step_id": lambda url: NebulaStorageWriter(f"{url}/step-4", step=3),
        "lightning": lightning,
        "huggingface_export": lambda url: export_pretrained(url, str(tmp_path / "hf")),
        # what Trainer(nebula_root=...) runs after transformers' own __init__
        "huggingface_trainer": lambda url: setup_trainer(object(), url, None),
        "torch_nebula_init": lambda url: torch_nebula.init(persistent_storage_path=url, memory_tier=False),
        "torch_nebula_init_tuple": lambda url: torch_nebula.init(persistent_storage_path=(url,), memory_tier=False),
    }


ENTRY_POINTS = ["Checkpointer", "save_async", "load_latest", "RemoteTier", "FsspecStorage", "cli_ls",
                "cli_verify_verbose", "cli_export", "NebulaStorageReader", "NebulaStorageReader_step_id",
                "dcp_load_checkpoint_id", "NebulaStorageWriter", "NebulaStorageWriter_step_id", "lightning",
                "huggingface_export", "huggingface_trainer", "torch_nebula_init", "torch_nebula_init_tuple"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("url, secret", SHAPES, ids=IDS)
def test_credentials_in_a_url_are_refused_and_never_shown(tmp_path: Path, entry: str, url: str, secret: str,
                                                          caplog: pytest.LogCaptureFixture,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    call = _entry_points(tmp_path)[entry]
    caplog.clear()
    capsys.readouterr()
    with caplog.at_level(logging.DEBUG):
        if entry.startswith("cli"):
            call(url)
            text = ""
        else:
            with pytest.raises(BaseException) as ei:
                call(url)
            text = _chain_text(ei.value)
    out = capsys.readouterr()
    # torch's own DCP event logger records the checkpoint_id given to dcp.load before any storage
    # reader sees it: out of this library's reach (README: pass the root to the reader instead)
    ours = [r for r in caplog.records if not r.name.startswith("c10d")]
    shown = "\n".join([text, out.out, out.err, *(r.getMessage() for r in ours), *(str(r.args) for r in ours),
                       *(logging.Formatter().formatException(r.exc_info) for r in ours if r.exc_info)])
    leaked = [p for p in _pieces(secret) if p in shown]
    assert not leaked, f"{entry} showed {leaked}:\n{shown[-3000:]}"
    # the refusal says what to do, and it came before anything was written
    assert "carries a password" in (text or out.err) and "storage_options" in (text or out.err), \
        (text or out.err)[-2000:]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("url, secret", SHAPES, ids=IDS)
def test_the_check_refuses_every_password_shape_without_showing_it(url: str, secret: str) -> None:
    with pytest.raises(ValidationError, match="carries a password.*storage_options") as ei:
        urls.refuse_url_credentials(url)
    assert not [p for p in _pieces(secret) if p in _chain_text(ei.value)]
    # the display helpers never parse such a URL: no secret, no parser error
    for text in (urls.strip_credentials(url), urls.canonical_root(url)):
        assert not [p for p in _pieces(secret) if p in text], text


@pytest.mark.parametrize("url", [
    "abfs://container@account.dfs.core.windows.net/path",   # Azure: container@account, no password
    "abfss://container@account.dfs.core.windows.net/run/a",
    "az://container@account.blob.core.windows.net/run",
    "az://container/run",
    "s3://bucket/path/with@sign/run",                       # '@' in the path, not in the host part
    "http://127.0.0.1:10000/devstoreaccount1/run",          # host:port
    "http://[::1]:9000/bucket/run",
    "memory://ckpt/run",
    "file:///tmp/run",
    "/tmp/a:b@c/run",                                       # a local path: not a URL
])
def test_urls_without_a_password_are_accepted(url: str) -> None:
    urls.refuse_url_credentials(url)


def test_an_azure_container_at_account_url_opens_as_adlfs_reads_it() -> None:
    """adlfs takes the account from ``container@account.dfs.core.windows.net`` and the container
    from the user part: the URL reaches it as given, and is shown as it is (nothing secret in it)."""
    pytest.importorskip("adlfs")
    from nebula_ckpt.storage.remote import FsspecStorage

    url = "abfs://container@account.dfs.core.windows.net/run/a"
    st = FsspecStorage(url, {"account_key": "bm90LWEtcmVhbC1rZXk="})
    try:
        assert st._root == "container/run/a"
        assert st.fs.account_name == "account"
        assert st.display_url == url and nc.RemoteTier(url).display_url == url
    finally:
        st.close()


def test_the_cli_never_echoes_a_query_string(capsys: pytest.CaptureFixture[str]) -> None:
    """A SAS token in the URL's query is neither used nor shown (the root is shown without it)."""
    from nebula_ckpt.cli import main as cli

    assert cli(["ls", "memory://nebula-cli-empty/run?sv=2022&sig=SUPERSECRETSIG0"]) == 1  # nothing there
    out = capsys.readouterr()
    assert "memory://nebula-cli-empty/run" in out.out and "SUPERSECRETSIG0" not in out.out + out.err
