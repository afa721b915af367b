"""Settings of the wrong type for the LMCache-style connector, and a lookup socket path too long (b12B).

1. `local_disk: false` (YAML `false` / `no` in LMCACHE_CONFIG_FILE, or `{"local_disk": False}` in
   kv_connector_extra_config) turned the disk tier ON in a folder named "./False"; `local_disk: 0` in "./0".
   Now false means off (None, as LMCache's unset local_disk), and a number is refused naming the setting.
2. A YAML / JSON boolean passed as a number: `max_local_cpu_size: true` -> 1.0 GB, `remote_timeout_s: yes`
   -> 1 s, `blocking_timeout_secs: on`, `max_local_disk_size: true`; `chunk_size: true` was refused only as
   "chunk_size (1) must be a multiple of the block size"; `remote_url: false` became the URL "False". Now a
   `ValueError` naming the setting and what it takes. Strings ("32", "False") convert as before.
3. A $TMPDIR long enough that the lookup socket's path passes the 107 bytes of a Unix socket path made every
   LMCache engine fail to start with a raw ZMQError. Now the socket moves to /tmp (logged), or, where /tmp
   is no writable folder, a `ValueError` naming TMPDIR and the limit comes before anything is started.
"""

import logging
import os
import tempfile
from pathlib import Path

import pytest

from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.lookup_client import (
    LMCacheLookupClient,
    LMCacheLookupServer,
    get_zmq_rpc_path_lmcache,
)
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import (
    CacheEngineKey,
    LMCacheEngineMetadata,
    lmcache_get_config,
)
from minivllm.utils import system_utils


def _from_yaml(tmp_path, text):
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return lmcache_get_config(None, {"LMCACHE_CONFIG_FILE": str(path)}).validate(16)


def _from_extra(extra):
    return lmcache_get_config(KVTransferConfig(kv_connector_extra_config=extra), {}).validate(16)


@pytest.mark.parametrize("text", ["local_disk: false\nmax_local_disk_size: 1", "local_disk: no\n"])
def test_local_disk_false_in_yaml_is_off(tmp_path, text, monkeypatch):
    """1. YAML `local_disk: false` / `no` was `local_disk='False'`, a folder ./False the engine created: the
    disk tier on. Now the tier is off (None), as with no local_disk, and a quoted string stays a folder."""
    monkeypatch.chdir(tmp_path)
    cfg = _from_yaml(tmp_path, text)
    assert cfg.local_disk is None and cfg.local_disk_path is None  # was 'False', Path('False')
    assert _from_yaml(tmp_path, "local_disk: 'False'\nmax_local_disk_size: 1").local_disk == "False"


def test_local_disk_false_in_the_extra_config_is_off():
    """1. `kv_connector_extra_config={"local_disk": False, "max_local_disk_size": 1}` was the folder
    'False'. Now off; and string booleans for bool settings still convert ("False", "off")."""
    assert _from_extra({"local_disk": False, "max_local_disk_size": 1}).local_disk is None  # was 'False'
    assert _from_extra({"local_cpu": "False", "chunk_size": "32"}).local_cpu is False
    assert _from_extra({"chunk_size": "32"}).chunk_size == 32
    assert lmcache_get_config(None, {"LMCACHE_LOCAL_CPU": "off"}).local_cpu is False


@pytest.mark.parametrize("text, name", [
    ("local_disk: true\nmax_local_disk_size: 1", "local_disk"),
    ("max_local_cpu_size: true", "max_local_cpu_size"),
    ("remote_timeout_s: yes", "remote_timeout_s"),
    ("blocking_timeout_secs: on", "blocking_timeout_secs"),
    ("chunk_size: true", "chunk_size"),
    ("max_local_disk_size: true\nlocal_disk: disk", "max_local_disk_size"),
    ("remote_url: false", "remote_url"),
])  # fmt: skip
def test_a_yaml_boolean_is_no_number_folder_or_url(tmp_path, text, name, monkeypatch):
    """2. `max_local_cpu_size: true` was a 1.0 GB tier, `remote_timeout_s: yes` a 1.0 s timeout,
    `chunk_size: true` "chunk_size (1) must be a multiple of the block size", `remote_url: false` the URL
    'False', `local_disk: true` the folder ./True. Now a ValueError naming the setting and what it takes."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"^{name} must be .*, not a boolean; got (True|False)$"):
        _from_yaml(tmp_path, text)


@pytest.mark.parametrize("extra, name", [
    ({"max_local_cpu_size": True}, "max_local_cpu_size"),
    ({"lmcache.chunk_size": True}, "chunk_size"),
    ({"remote_timeout_s": False}, "remote_timeout_s"),
    ({"remote_url": True}, "remote_url"),
])  # fmt: skip
def test_a_json_boolean_in_the_extra_config_is_no_number_or_url(extra, name):
    """2. The extra config's `{"max_local_cpu_size": True}` was 1.0 GB (and `False` a 0 GB tier, refused
    only as "must be > 0 GB with local_cpu"). Now a ValueError naming the setting, "not a boolean"."""
    with pytest.raises(ValueError, match=rf"^{name} must be .*, not a boolean"):
        _from_extra(extra)
    assert _from_extra({"max_local_cpu_size": 0.25}).max_local_cpu_size == 0.25


def test_a_number_is_no_folder(tmp_path, monkeypatch):
    """1. YAML `local_disk: 0` was the folder ./0 (and `remote_url: 6379` the URL '6379', refused only by
    the URL check). Now 'local_disk must be a string'; a quoted '0' is still a folder named 0."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^local_disk must be a string, a folder path .*; got int 0$"):
        _from_yaml(tmp_path, "local_disk: 0\nmax_local_disk_size: 1")
    with pytest.raises(ValueError, match=r"^remote_url must be a string, a redis://"):
        _from_extra({"remote_url": 6379})
    assert _from_yaml(tmp_path, "local_disk: '0'\nmax_local_disk_size: 1").local_disk == "0"


class _Store:  # the one method of StorageManager the lookup server uses
    def prefix_lookup(self, keys):
        return len(keys)


@pytest.fixture
def long_tmpdir(monkeypatch):
    "A TMPDIR of ~100 characters, as `tempfile` sees it once TMPDIR is read (removed after)."
    root = Path(tempfile.mkdtemp(prefix="b12B-"))
    long = root / ("x" * 80)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    yield long
    monkeypatch.undo()
    long.rmdir()
    root.rmdir()


def test_a_long_tmpdir_moves_the_lookup_socket_to_tmp(long_tmpdir, caplog):
    """3. With TMPDIR of 92+ characters the path was TMPDIR/minivllm-lmcache-<tag>-0.sock, ~140 bytes, and
    the server's bind raised `ZMQError ... longer than 107 characters`. Now the path is in /tmp (<= 107
    bytes, logged naming TMPDIR), a server binds it, a client is answered, and close removes the file."""
    assert len(str(long_tmpdir)) > 92
    engine_id = f"long-tmpdir-{os.getpid()}"
    with caplog.at_level(logging.WARNING, logger=system_utils.__name__):
        path = get_zmq_rpc_path_lmcache(engine_id, 0)
    assert path.startswith("ipc:///tmp/minivllm-lmcache-")
    assert len(os.fsencode(path.removeprefix("ipc://"))) <= 107
    assert get_zmq_rpc_path_lmcache(engine_id, 0) == path  # scheduler and worker agree
    assert any("TMPDIR" in r.getMessage() and "107" in r.getMessage() for r in caplog.records)
    meta = LMCacheEngineMetadata("toy")
    server = LMCacheLookupServer(_Store(), meta, path)  # was: ZMQError
    client = LMCacheLookupClient(path, timeout_s=5.0)
    try:
        assert client.lookup([CacheEngineKey.of(meta, "ab").chunk_hash, "cd"]) == 2
    finally:
        client.close()
        server.close()
    assert not Path(path.removeprefix("ipc://")).exists()


def test_a_long_tmpdir_with_no_usable_fallback_names_tmpdir(long_tmpdir, monkeypatch):
    """3. Where /tmp is no writable folder either, the raw ZMQError came from the worker's bind, after the
    connector had started building. Now `get_zmq_rpc_path_lmcache` (called before anything starts) raises
    a ValueError naming TMPDIR and the 107-byte limit."""
    monkeypatch.setattr(system_utils, "IPC_FALLBACK_DIR", str(long_tmpdir / "absent"))  # chapter 24d's rule
    with pytest.raises(ValueError, match=r"^TMPDIR '.*x{80}' \(\d+ bytes\) is too long .* at most 107 bytes"):
        get_zmq_rpc_path_lmcache("no-fallback", 0)
