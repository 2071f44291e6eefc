"""`sparseflow train --agreement-tls-dir / --agreement-secret-file` over the config's values."""

import argparse
from pathlib import Path

import pytest

from sparseflow import _train_command, load_config, shipped_config

CONFIG = shipped_config("demo")


def parse(*argv):
    parser = argparse.ArgumentParser()
    _train_command.add_arguments(parser)
    return parser.parse_args(["--config", str(CONFIG), *argv])


@pytest.mark.parametrize(
    "argv, tls_dir, secret_file",
    [
        ((), None, None),
        (("--agreement-tls-dir", "/etc/tls"), Path("/etc/tls"), None),
        (("--agreement-secret-file", "secret"), None, Path("secret").absolute()),
    ],
)
def test_the_command_line_sets_the_agreement_security(argv, tls_dir, secret_file):
    config = _train_command.with_agreement_security(parse(*argv), load_config(CONFIG))
    assert (config.training.agreement_tls_dir, config.training.agreement_secret_file) == (
        tls_dir,
        secret_file,
    )
    security = config.training.agreement_security(run_id=config.config_hash)
    assert (security is None) == (tls_dir is None and secret_file is None)


def test_a_multi_host_run_hands_the_security_to_its_agreement(tmp_path, monkeypatch):
    """The agreement a training run builds carries the configured secret."""
    from sparseflow import _train

    secret = tmp_path / "secret"
    secret.write_bytes(b"a shared secret of this run")
    config = _train_command.with_agreement_security(
        parse("--agreement-secret-file", str(secret)), load_config(CONFIG)
    )
    monkeypatch.setattr(_train.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_train.jax, "process_index", lambda: 1)
    options = _train.TrainOptions(data=str(tmp_path), agreement_port=23456)
    agreement = _train._agreement(config, options)
    assert agreement.rank == 1
    assert agreement.security == config.training.agreement_security(run_id=config.config_hash)
    assert agreement.security.secret_file == secret
