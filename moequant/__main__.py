"""`python -m moequant ...`, and so `torchrun --nproc-per-node N -m moequant apply ...` (expert-parallel,
moequant.parallel): the command line of moequant.cli."""

from moequant.cli import main

if __name__ == "__main__":
    main(prog_name="moequant")
