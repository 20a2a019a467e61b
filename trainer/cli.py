"""``lgt-train``: the trainer's command line (inspection commands work without torch)."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """lgt's trainer: inspect the store, join rewards, build samples (training arrives with `run`)."""


if __name__ == "__main__":
    main()
