"""``horovod.runner.common.util`` on hora."""
