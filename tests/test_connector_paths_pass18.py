"""Eighteenth break pass, F3/F4: connector folder settings that the system refuses to look up (a name
too long, a NUL byte) are a `ValueError` naming the field; ExampleConnector logs a full disk once, not
once per block."""

import errno
import logging
import os

import pytest
import torch

from minivllm.distributed.kv_transfer.kv_connector.v1 import example_connector as ec_mod
from minivllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    shared_storage_folder,
)
from minivllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.utils import LMCacheEngineConfig


@pytest.mark.parametrize("config_name", ["kv_connector_extra_config", "ec_connector_extra_config"])
@pytest.mark.parametrize("bad", ["x" * 300, "a\x00b", "sub/" + "y" * 256 + "/z"])
def test_shared_storage_path_too_long_or_nul_names_the_field(tmp_path, config_name, bad):
    value = bad if bad.startswith("a\x00") else str(tmp_path / bad)
    with pytest.raises(ValueError) as info:
        shared_storage_folder({"shared_storage_path": value}, config_name)
    msg = str(info.value)
    assert msg.startswith(f"{config_name}['shared_storage_path'] must name a folder"), msg
    assert "no NUL byte, each name at most 255 bytes" in msg
    assert ("NUL byte" in msg.split("(")[-1]) if "\x00" in value else ("longer than the filesystem" in msg)


def test_shared_storage_path_still_takes_a_good_folder(tmp_path):
    assert shared_storage_folder({"shared_storage_path": str(tmp_path / "a")}, "x").is_dir()


@pytest.mark.parametrize("bad", ["x" * 300, "a\x00b", "file:///tmp/a\x00b", "/tmp/" + "z" * 400])
def test_local_disk_too_long_or_nul_names_the_field(bad):
    with pytest.raises(ValueError) as info:
        LMCacheEngineConfig(local_disk=bad, max_local_disk_size=1.0).validate()
    msg = str(info.value)
    assert msg.startswith(f"local_disk {bad!r} cannot be used"), msg
    assert "folder path or a file:///absolute/path URL" in msg


def _connector(folder):
    """An ExampleConnector with only its save path set up (no engine)."""
    c = object.__new__(ExampleConnector)
    c._storage, c._tp_size, c._tp_rank, c._folder_lost = folder, 1, 0, False
    c.num_save_errors, c._failed_run = 0, 0
    c._kv_caches, c._pending = {"layer.0": None}, {}
    return c


def _step(c, keys):
    c._pending = {k: {"layer.0": torch.zeros(2, 2)} for k in keys}
    c.wait_for_save()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_full_disk_is_logged_once_until_a_save_works(tmp_path, monkeypatch, caplog, code):
    c = _connector(tmp_path)

    def full(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    real_save = ec_mod.save_file
    monkeypatch.setattr(ec_mod, "save_file", full)
    caplog.set_level(logging.INFO, logger=ec_mod.logger.name)
    for step in range(4):
        _step(c, [f"k{step}{i}" for i in range(5)])
    assert c.num_save_errors == 20
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert os.strerror(code) in warnings[0].getMessage()
    assert not list(tmp_path.glob("*.tmp"))  # each failed save removed its temporary file
    monkeypatch.setattr(ec_mod, "save_file", real_save)  # space was freed
    _step(c, ["ok0", "ok1"])
    assert (tmp_path / "ok0.safetensors").is_file()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "after 20 failed saves" in infos[0], infos
    monkeypatch.setattr(ec_mod, "save_file", full)  # full again: a new run, logged again
    _step(c, ["k9a", "k9b"])
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    assert c.num_save_errors == 22
