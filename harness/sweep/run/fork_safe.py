"""Imported first by the sweep's fork server (starter.PRELOAD). transformers imports torchao
whenever it is installed (its quantizers), and torchao asks torch.cuda about the device as it
is imported (`is_available`, `get_device_capability`), which would initialise CUDA in the
server and leave every trial forked from it unable to use the GPU. The server's transformers
is told torchao is absent; a trial imports torchao itself, after the fork, when its method
needs it (methods/adam4bit.py)."""

import transformers.utils
from transformers.utils import import_utils


def _absent(*args: object, **kwargs: object) -> bool:
    return False


import_utils.is_torchao_available = _absent
transformers.utils.is_torchao_available = _absent
