"""Puts torch_stage.DataLoader in the place of torch.utils.data.DataLoader in
every Python process of a run (the test process, processes it spawns, ``python
-c`` subprocesses) when TORCH_STAGE_DROPIN=1; see run.sh.

torch_stage.DataLoader subclasses the plain class it saw when imported, so
rebinding the public names afterwards cannot recurse.
"""

import os

if os.environ.get("TORCH_STAGE_DROPIN") == "1":
    import torch.utils.data
    import torch.utils.data.dataloader

    import torch_stage

    if torch_stage.DataLoader.__mro__[1] is not torch.utils.data.DataLoader:
        raise RuntimeError("torch_stage.DataLoader does not subclass the plain DataLoader")
    torch.utils.data.DataLoader = torch_stage.DataLoader
    torch.utils.data.dataloader.DataLoader = torch_stage.DataLoader
