"""Own tests of pytest-dflash.

torch is imported here, once, before any pytester inline run: pytester restores sys.modules
after each inline run, and a C extension such as torch cannot be imported a second time.
"""

import torch  # noqa: F401
