"""`gpuhook simulate DIR`: build a simulated GPU host (see gpuhook.simulate.host)."""

import click

from gpuhook.simulate import host


@click.command(help=(
    "Build a simulated NVIDIA GPU host under DIR: driver libraries, binaries and firmware, "
    "device nodes with NVIDIA's numbers, /proc driver files, and DIR/config.toml pointing "
    "gpuhook at them. Use it with GPUHOOK_CONFIG=DIR/config.toml or --config. Needs root."
))
@click.argument("directory", metavar="DIR")
@click.option("--gpus", default=2, show_default=True, help="Number of GPUs.")
@click.option("--driver-version", default=host.DEFAULT_DRIVER_VERSION, show_default=True)
@click.option("--model", default=host.DEFAULT_MODEL, show_default=True)
def simulate(directory, gpus, driver_version, model):
    built = host.build(directory, gpus=gpus, driver_version=driver_version, model=model)
    click.echo(f"simulated host with {len(built['gpus'])} GPU(s), driver {built['driver_version']}, in {built['directory']}")
    for gpu in built["gpus"]:
        click.echo(f"  GPU {gpu['index']}  {gpu['uuid']}  {gpu['bus_id']}  {gpu['model']}")
    click.echo(f"use it with: GPUHOOK_CONFIG={built['config']} gpuhook list")
