"""The second H200 lease's second call: full AdamW's MFU over micro-batches at LLaMA-1B
(the kit's table11 part runs its eight rows first; on the first lease its cap ended before
this sweep). `python mfu.py OUT`, after the kit's install line; nothing else on the device."""

import json
import sys
from pathlib import Path

from harness.bench.gpu_parts import GPU, _mfu

out = Path(sys.argv[1])
with (out / "mfu.jsonl").open("w") as f:
    for record in _mfu(GPU):
        print(record, flush=True)
        f.write(json.dumps(record) + "\n")
        f.flush()
