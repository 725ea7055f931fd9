"""The installed megatron-core version, for the few places whose behaviour differs between releases.

Supported: megatron-core >= 0.16.1, < 0.20 (``megatron.training.initialize.SUPPORTED_MCORE``): 0.16.1, 0.17.x,
0.18.x and 0.19.x, each run by the CPU suite. Code that works on every supported release needs no gate; each gate
names the release that changed the behaviour.
"""

from packaging.version import Version

from megatron.core.package_info import __version__

MCORE_VERSION = Version(__version__)


def mcore_at_least(version: str) -> bool:
    """True if the installed megatron-core is ``version`` or newer (pre-releases of it count as it)."""
    return MCORE_VERSION.release >= Version(version).release
