"""``horovod.runner.util`` on hora."""
