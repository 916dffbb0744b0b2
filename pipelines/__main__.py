"""`python -m pipelines`: see pipelines.cli."""

from pipelines.cli import main

if __name__ == "__main__":
    main()
