"""``horovod.common.exceptions`` on hora: the same classes as :mod:`hora.errors`.

One class per meaning, shared with ``hora``: ``except
horovod.common.exceptions.HorovodInternalError`` catches what hora raises.
"""

from hora.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "get_version_mismatch_message"]


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    """Horovod's message for a framework whose version differs from the one it was built with.

    hora is pure Python over the installed framework, so it never raises this;
    the helper is here for scripts that format the message themselves.
    """
    return (f"Framework {name} installed with version {installed_version} but found version "
            f"{version}. This can result in unexpected behavior including runtime errors. "
            f"Reinstall Horovod using `pip install --no-cache-dir` to build with the new "
            f"version.")
