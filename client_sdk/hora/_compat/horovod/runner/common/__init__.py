"""``horovod.runner.common`` on hora."""
