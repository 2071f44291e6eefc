"""`sparseflow train --agreement-tls-dir / --agreement-secret-file` over the config's values."""

import argparse
from pathlib import Path

import pytest

from sparseflow import _train_command, load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


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
