"""``python -m gpucheck.part CTX_JSON``: run one part in this process (started by the harness).

Prints one ``GPUCHECK_RESULT {json}`` line at the end: status, rows written, the part's summary
or the error. Everything else it prints goes to the run's log.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

from gpucheck.common import Budget, BudgetExceeded, PartContext, RowWriter, error_text
from gpucheck.harness import PARTS, RESULT_TAG
from gpucheck.schema import columns


def main(argv: list[str]) -> int:
    ctx = PartContext.load(Path(argv[0]))
    spec = next(p for p in PARTS if p.name == ctx.name)
    module = importlib.import_module(f"gpucheck.parts.{spec.module}")
    writer = RowWriter(Path(ctx.out) / module.FILE, columns(module.FILE), ctx.provenance)
    budget = Budget(ctx.budget_s)
    result: dict = {"status": "ok", "rows": 0}
    try:
        summary = module.run(ctx, writer, budget) or {}
        result["summary"] = summary
        result["status"] = summary.pop("_status", "ok")
    except BudgetExceeded as exc:
        result.update(status="partial", error=str(exc))
    except Exception as exc:  # noqa: BLE001 - the part failed; the harness goes on
        traceback.print_exc()
        result.update(status="error", error=error_text(exc))
        writer.write(status="error", note=f"part aborted: {error_text(exc)}",
                     **getattr(module, "ERROR_ROW", {}))
    finally:
        result["rows"] = writer.rows
        writer.close()
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
