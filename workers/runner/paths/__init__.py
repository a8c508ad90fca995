"""Forward paths: the ways one step's forward pass can run. The runner tries the engine's
`forward_paths` in order and takes the first that accepts the step (`base.ForwardPath`).

    native        CPU: up to eight decode rows as one C call (the whole forward and LM head)
    cuda_graphs   CUDA: decode-only steps replayed as graphs captured at start, per bucket
    compiled      decode-only steps through torch.compile
    eager         every step, layer by layer (always last: it accepts anything)

A new path is a module here with a `ForwardPath` subclass, registered below by name.
"""

from __future__ import annotations

from typing import Literal

ForwardPathName = Literal["native", "cuda_graphs", "compiled", "eager"]

# name -> "module:class" under this package (imported when an engine builds its paths).
FORWARD_PATHS: dict[str, str] = {
    "native": "native:NativePath",
    "cuda_graphs": "cuda_graphs:CudaGraphsPath",
    "compiled": "compiled:CompiledPath",
    "eager": "eager:EagerPath",
}
