"""`python -m gpuvisor.supervisor`: the gpuvisor command line."""

from gpuvisor.supervisor.cli import main

if __name__ == "__main__":
    main(prog_name="gpuvisor")
