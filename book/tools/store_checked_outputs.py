"""Execute the book's notebooks and store the outputs of the checked cells only.

nbval (``--nbval-lax``) compares a cell's fresh output with its stored one only for
cells tagged ``nbval-check-output``; every other cell is stored without outputs, so the
notebooks stay small and free of machine-specific text. Run from the repository root
after changing a checked cell::

    python book/tools/store_checked_outputs.py book/*.ipynb
"""

import sys
from pathlib import Path

import nbclient
import nbformat


def main(paths):
    for p in map(Path, paths):
        nb = nbformat.read(p, as_version=4)
        nbclient.NotebookClient(
            nb,
            kernel_name="python3",
            timeout=900,
            resources={"metadata": {"path": str(p.parent)}},
        ).execute()
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            if "nbval-check-output" not in cell.metadata.get("tags", []):
                cell.outputs = []
                cell.execution_count = None
            else:
                cell.outputs = [o for o in cell.outputs if o.get("name") != "stderr"]
        nbformat.write(nb, p)
        print("stored", p)


if __name__ == "__main__":
    main(sys.argv[1:])
