/*
 * Preloaded into NFS-Ganesha by `cachefs export --run` (cachefs/cli/export.py).
 *
 * Ganesha puts a file system id in every NFS file handle: statfs's f_fsid, or,
 * where that is zero as on every FUSE mount, the device number, which the
 * kernel assigns anew to each mount. So a remounted spoke would make every
 * handle its clients hold stale. This gives the exported FUSE mount (the path
 * in CACHEFS_NFS_MOUNT) the fixed f_fsid in CACHEFS_NFS_FSID (16 hex digits);
 * every other statfs answer is passed through untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/vfs.h>

#define FUSE_SUPER_MAGIC 0x65735546

static void set_fsid(const char *path, struct statfs *buf)
{
	const char *mount = getenv("CACHEFS_NFS_MOUNT");
	const char *fsid = getenv("CACHEFS_NFS_FSID");
	unsigned long long value;

	if (mount == NULL || fsid == NULL || buf->f_type != FUSE_SUPER_MAGIC || strcmp(path, mount) != 0)
		return;
	value = strtoull(fsid, NULL, 16);
	buf->f_fsid.__val[0] = (int)(value >> 32);
	buf->f_fsid.__val[1] = (int)(value & 0xffffffffu);
}

int statfs(const char *path, struct statfs *buf)
{
	static int (*real)(const char *, struct statfs *);
	int result;

	if (real == NULL)
		real = (int (*)(const char *, struct statfs *))dlsym(RTLD_NEXT, "statfs");
	result = real(path, buf);
	if (result == 0)
		set_fsid(path, buf);
	return result;
}

/* The same structure on 64-bit Linux; Ganesha calls this one. */
int statfs64(const char *path, struct statfs64 *buf)
{
	static int (*real)(const char *, struct statfs64 *);
	int result;

	if (real == NULL)
		real = (int (*)(const char *, struct statfs64 *))dlsym(RTLD_NEXT, "statfs64");
	result = real(path, buf);
	if (result == 0)
		set_fsid(path, (struct statfs *)buf);
	return result;
}
