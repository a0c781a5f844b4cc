"""Pipeline parallelism: layer partition, schedules as data, simulator, executor."""
