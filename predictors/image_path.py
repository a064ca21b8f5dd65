"""Whether a command's image path names a file matplotlib can write, asked before any work.

Shared by ``cona plot --out`` and ``kvpool status --plot``. It lives in ``predictors`` because
the wheel installs ``predictors`` with both plugins, CONA already imports from it, and it
imports neither plugin (``support/`` is not installed), so no plugin depends on the other and
no import circle forms. matplotlib loads only when a path is checked.
"""

from __future__ import annotations

from pathlib import Path


def image_path_problem(path: Path, example_name: str) -> str | None:
    """What is wrong with ``path`` as an image file, or None. matplotlib's own error names
    neither the flag nor the path, and without a suffix it writes ``path`` + ".png" (a directory
    ``d``: ``d.png``; an empty path: ``./.png``) while the command prints ``path``.
    ``example_name`` is the file name the directory message suggests inside it."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.is_dir():
        return f"{path} is a directory; name the image file (e.g. {path / example_name})"
    if not path.suffix:
        return f"{str(path)!r} has no suffix to choose the format ({', '.join(formats)})"
    if path.suffix[1:].lower() not in formats:
        return f"{path}: matplotlib writes no {path.suffix} files ({', '.join(formats)})"
    return None
