"""The read path below FUSE: split reads into blocks and get each from memory, a flight, the disk cache or the hub."""
