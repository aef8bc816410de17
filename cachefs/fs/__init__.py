"""The FUSE layer: pyfuse3 Operations, passthrough of whole cached files, finding mounts."""
