"""``horovod.common`` on hora: framework-neutral helpers and errors."""
