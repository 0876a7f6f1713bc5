/* cairn-spawn: the worker agent's resident starter of attempts (a "zygote"), and their
 * parent.
 *
 * The agent starts it with posix_spawn, hands it one end of a SOCK_SEQPACKET socket pair
 * (its number is argv[2]) and, on cgroup v1, the cgroup.procs files it joins once
 * (argv[3..]): every attempt it starts afterwards is born inside those cgroups, with no
 * migration. For each request it clones a child of its own that shares its memory until
 * its exec (CLONE_VM | CLONE_VFORK, as posix_spawn does: this process waits meanwhile),
 * or a copy of it straight into a cgroup v2 folder (clone3 CLONE_INTO_CGROUP), and the
 * child applies, as root and in this order: a process group of its own (in this process's
 * session, which it made at its start: no controlling terminal), a private mount namespace with its own home (a tmpfs the
 * agent made), its sealed executable bound on its path, and /tmp, a network namespace of its own with loopback only (egress
 * "none"), rlimits, the attempt's uid and gid with no other groups, no_new_privs, umask
 * 077, its working directory, stdin /dev/null and stdout/stderr the log, every other
 * descriptor closed, every signal unblocked; then it execs the task. The reply says the
 * child's pid and, if it failed before the exec (then reaped here), at which step and
 * with which errno.
 *
 * When attempts end (SIGCHLD, read from a signalfd beside the socket), it kills each
 * one's process group while its leader is an unreaped zombie (so the group's id cannot
 * have been reused), reaps it with wait4 and sends its exit record: pid, wait status,
 * user and system CPU, peak resident set; all that ended together in one message. The
 * cgroup v1 slot it joined keeps the attempt's counters: it resets them (peak memory,
 * CPU usage) before each start and says the OOM-kill count then in its reply; at the
 * exit it reads them again (peak, CPU, OOM kills since the start) and whether the slot
 * then held no process but itself (pids.current 1: nothing of the attempt is left, so
 * the figures are final), all in the exit record. The
 * agent keeps no watcher per attempt. End of file on the socket: the agent is gone, so
 * is this process (its attempts still running are orphans then, which the agent's
 * sidecar kills).
 *
 * A request is a list of NUL-terminated fields, each a tag byte and its value:
 *   x path     the executable          a arg   one argv entry, in order
 *   e K=V      one environment entry   d dir   the working directory
 *   u uid      g gid                   r N=V   an rlimit (resource number = value)
 *   t dir      the private /tmp source T path  a target bound on it (/tmp, /var/tmp)
 *   s          a fresh /dev/shm        c       the second descriptor is a cgroup2 folder
 *   n          a network namespace of its own, loopback up (nothing else)
 *   i          an IPC namespace of its own: the System V shared memory, message queues
 *              and semaphores it makes end with its last process, seen by no other
 *   m dir      the passed detached mount (the attempt's tmpfs, made by the agent with
 *              fsmount) is attached on dir in the attempt's mount namespace: its home
 *   b path     the sealed executable, bound on the executable's path (x) in the
 *              attempt's mount namespace: the file it runs, seen there only
 *   o path     a file:// source checked first, by a checker process before the clone,
 *              opened as the attempt (its uid and gid as the filesystem ids, no groups)
 *              in the host's mount namespace: it must be
 *   O stamp    the file of this stamp (st_dev:st_ino:st_size:mtime ns:ctime ns) on a
 *   F types    file system of one of these types (statfs f_type, hexadecimal, comma-
 *              separated), else the start fails at step "source" (ESTALE, or the open's
 *              errno) and the agent seals the source again (the stamp the agent
 *              remembered is what it hashed: artifacts.FileStamps)
 *   q quota    the attempt's CPU quota, written once the child has exec'd (apply_quota):
 *              "US" to the joined v1 slot's cpu.cfs_quota_us, or "US PERIOD" to the
 *              passed cgroup2 folder's cpu.max (with c); else the start fails at step
 *              "CPU quota" (the attempt killed and reaped: no exit record)
 *   W ms       within this many milliseconds (given with o), else the start fails at step
 *              "source" with ETIMEDOUT (begin_check, end_check: the open runs in a checker
 *              process this one waits for no longer; EBUSY while an earlier checker of
 *              the same path still hangs, or if the earlier check of the same path this
 *              start waited for did not answer in time (hung_path); EAGAIN while
 *              MAX_STUCK checkers of any paths hang, while MAX_PENDING starts wait for
 *              their checks already, or if no checker could be made; EIO if the checker
 *              died unanswered; ECANCELED if its uid was killed while it was checked)
 * with the log file's descriptor (then the cgroup folder's, then the mount's) passed
 * along (SCM_RIGHTS). While a start's source is checked, this process serves its other
 * requests (pending, main's poll): that start's reply comes when the check ends. It
 * reads its socket at all times, so no check holds back another request.
 * A request "k uid" instead kills every process of that uid (a reply, at once; the
 * pending starts of that uid never start: answer_kill; a uid that is 0 or none is
 * refused, EINVAL, nothing killed); "S pid signal" signals the
 * process group of the attempt pid, only while it is a child not yet reaped (no reply);
 * "h" asks only how many checkers still hang (a reply: each reply says how many were
 * kept then, so a helper that starts nothing would go on counting those that ended
 * since, reaped as they end). Each reply carries the
 * number of its request (seq: 1 for the first request that has a reply, 0 for the ready
 * message), as replies to checked starts may come after later requests' replies.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <net/if.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/fsuid.h>
#include <sys/vfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <limits.h>
#include <time.h>
#include <unistd.h>

#define MAX_REQUEST (1 << 20)
#define MAX_ITEMS 4096
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

enum step { OK, SESSION, MOUNTS, LIMITS, IDENTITY, PRIVS, WORKDIR, DESCRIPTORS, EXEC, CLONE,
            NETWORK, SOURCE, IPC, KEYRINGS, CPU_QUOTA };

/* What the helper sends: a reply to each request, numbered as its request (seq; in
 * order but for a start whose source is checked, which comes when its check ends), and
 * exit records. A spawn's reply says its slot's OOM-kill count before the start (-1: no
 * slot counters); the ready message, whether it keeps them (flag 1) and whether it can
 * write the slot's CPU quota (flag 2; 0: neither). Every reply
 * to a request says how many checkers of sources that did not answer still hang. */
enum kind { REPLY = 1, EXITS = 2 };
struct reply { int32_t kind, pid, step, err; int64_t oom_base, hung, seq; };
/* One attempt that ended, reaped by wait4: its status and rusage (microseconds, KiB);
 * its slot's peak memory (bytes) and CPU (ns) since its start, its OOM kills, and whether
 * nothing of it was left in the slot (1; 0: something was; -1 for what is not known). */
struct exit_record {
    int32_t pid, status;
    int64_t utime_us, stime_us, maxrss_kb, peak_bytes, cpu_ns;
    int32_t oom_kills, alone;
};
#define MAX_EXITS 256
struct exits { int32_t kind, count; struct exit_record records[MAX_EXITS]; };

struct request {
    char *exe, *dir, *tmp, *mount_at, *bind_from, *source, *stamp, *fstypes, *quota;
    char *argv[MAX_ITEMS], *envp[MAX_ITEMS], *targets[8];
    int argc, envc, ntargets, shm, has_cgroup, nlimits, netns, ipc, source_ms;
    long uid, gid;
    int limit_which[16];
    unsigned long long limit_value[16];
    int log_fd, cgroup_fd, mount_fd;
};

static char buffer[MAX_REQUEST];

/* The joined v1 slot's counters, opened once (-1: not there): the peak memory and CPU
 * usage, reset before each start; the OOM-kill count; the processes in the slot. And its
 * CPU quota (cpu.cfs_quota_us), written once a start has exec'd (a request's q). */
static int peak_fd = -1, cpu_fd = -1, oom_fd = -1, pids_fd = -1, quota_fd = -1;
static int64_t oom_base = -1;

/* A number from a counter file: the whole file, or the value after "key " in it. */
static int64_t counter(int fd, const char *key) {
    char text[4096];
    if (fd < 0) return -1;
    ssize_t size = pread(fd, text, sizeof text - 1, 0);
    if (size <= 0) return -1;
    text[size] = '\0';
    char *at = text;
    if (key) {
        size_t length = strlen(key);
        for (at = text; at; at = strchr(at, '\n'), at = at ? at + 1 : NULL)
            if (strncmp(at, key, length) == 0 && at[length] == ' ') break;
        if (!at) return -1;
        at += length + 1;
    }
    char *end;
    errno = 0;
    long long value = strtoll(at, &end, 10);
    return end == at || errno ? -1 : (int64_t)value;
}

/* Before a start: the peak and the CPU usage back to 0, the OOM-kill count noted. */
static void reset_counters(void) {
    oom_base = -1;
    if (peak_fd < 0 || cpu_fd < 0 || pwrite(peak_fd, "0", 1, 0) < 0 || pwrite(cpu_fd, "0", 1, 0) < 0)
        return;
    oom_base = counter(oom_fd, "oom_kill");
}

static void read_counters(struct exit_record *record) {
    int64_t kills = counter(oom_fd, "oom_kill"), pids = counter(pids_fd, NULL);
    record->peak_bytes = oom_base >= 0 ? counter(peak_fd, NULL) : -1;
    record->cpu_ns = oom_base >= 0 ? counter(cpu_fd, NULL) : -1;
    record->oom_kills = oom_base >= 0 && kills >= 0 ? (int32_t)(kills - oom_base) : -1;
    record->alone = pids < 0 ? -1 : pids == 1;
}

/* A uid or gid: 0 to UINT32_MAX - 1 (-1 is "unchanged" to setfsuid; anything larger
 * would be truncated to another id), the whole value a number. */
static int parse_id(const char *value, long *id) {
    char *end;
    errno = 0;
    long long got = strtoll(value, &end, 10);
    if (errno || end == value || *end || got < 0 || got >= (long long)UINT32_MAX) return -1;
    *id = (long)got;
    return 0;
}

/* A quota's text: a number, or two separated by one space (cgroup2's "quota period"). */
static int valid_quota(const char *value) {
    size_t first = strspn(value, "0123456789"), length = strlen(value);
    if (first == 0 || first > 18) return 0;
    if (first == length) return 1;
    const char *second = value + first + 1;
    size_t rest = strspn(second, "0123456789");
    return value[first] == ' ' && rest > 0 && rest <= 18 && second[rest] == '\0';
}

static int parse(char *data, size_t size, struct request *r) {
    memset(r, 0, sizeof *r);
    r->uid = r->gid = -1;
    for (char *p = data; p < data + size; p += strlen(p) + 1) {
        char tag = p[0], *value = p + 1;
        switch (tag) {
        case 'x': r->exe = value; break;
        case 'd': r->dir = value; break;
        case 't': r->tmp = value; break;
        case 'm': r->mount_at = value; break;
        case 'b': r->bind_from = value; break;
        case 'o': r->source = value; break;
        case 'O': r->stamp = value; break;
        case 'F': r->fstypes = value; break;
        case 'W': r->source_ms = (int)strtol(value, NULL, 10); break;
        case 'q':
            if (!valid_quota(value)) return -1;
            r->quota = value;
            break;
        case 's': r->shm = 1; break;
        case 'c': r->has_cgroup = 1; break;
        case 'n': r->netns = 1; break;
        case 'i': r->ipc = 1; break;
        case 'u': if (parse_id(value, &r->uid) < 0) return -1; break;
        case 'g': if (parse_id(value, &r->gid) < 0) return -1; break;
        case 'a': if (r->argc < MAX_ITEMS - 1) r->argv[r->argc++] = value; else return -1; break;
        case 'e': if (r->envc < MAX_ITEMS - 1) r->envp[r->envc++] = value; else return -1; break;
        case 'T': if (r->ntargets < 8) r->targets[r->ntargets++] = value; else return -1; break;
        case 'r':
            if (r->nlimits >= 16) return -1;
            r->limit_which[r->nlimits] = (int)strtol(value, &value, 10);
            r->limit_value[r->nlimits++] = strtoull(value + 1, NULL, 10);
            break;
        default: return -1;
        }
    }
    if (r->source && (!r->stamp || !r->fstypes || r->uid < 0 || r->gid < 0 || r->source_ms <= 0))
        return -1;
    return r->exe && r->argc > 0 ? 0 : -1;
}

static void fail(int status_fd, enum step step) {
    struct reply reply = {REPLY, 0, step, errno, -1, 0, 0};
    if (write(status_fd, &reply, sizeof reply) < 0) _exit(126);
    _exit(127);
}

/* The kernel's keyrings the attempt reaches, made its own. Its session keyring: the
 * agent's (under systemd a service has one) would be every attempt's, and possessing a
 * keyring grants its possessor's rights whatever the uid. So the attempt inherits the
 * one this process made and sealed at its start (seal_keyring, below); where that could
 * not be, it joins one of its own as root (before the uid is dropped: charged to root's
 * quota, so a uid whose quota an earlier attempt filled still gets one). Then its uid's
 * user, user-session and persistent keyrings emptied of what an earlier attempt of the
 * uid left there (empty_persistent, empty_keyrings): they outlive their processes (the
 * persistent one for
 * kernel.keys.persistent_keyring_expiry). One the uid's quota has no room to make did
 * not exist, so held nothing (EDQUOT); nothing to do without keys in the kernel
 * (ENOSYS) or persistent keyrings (EOPNOTSUPP), nor where a seccomp filter refuses
 * keyctl to every process (EPERM: Docker's default profile). */
#define KEYCTL_JOIN 1
#define KEYCTL_EMPTY 7
#define KEYCTL_PERSISTENT 22
#define KEYRING_SESSION (-3)
#define KEYRING_USER (-4)
#define KEYRING_USER_SESSION (-5)
static int nothing_there(void) {
    return errno == ENOSYS || errno == EOPNOTSUPP || errno == EDQUOT;
}
/* 0: joined; 1: no keyrings here; -1: failed */
static int join_keyring(void) {
    if (syscall(SYS_keyctl, KEYCTL_JOIN, NULL) >= 0) return 0;
    return errno == ENOSYS || errno == EPERM ? 1 : -1;
}
/* Set (sealed_keyring) when this process's session keyring, which its attempts inherit,
 * is one it made at its start and sealed: root's, and its possessors (the attempts) may
 * see it (KEY_POS_VIEW) but not search, write, link, invalidate it or change its rights,
 * so no attempt stores anything there for another to find, nor spoils it for the next.
 * (A possessor may list what it links: nothing, but for the moment root empties a
 * persistent keyring through it, whose keys no one who cannot search it reaches.) Then an attempt joins no keyring of its own: each one made and
 * freed at its end had the kernel's key collector walk every key on the host (each uid
 * handed out keeps its user and user-session keyrings for good: 30,000 keys after a pool
 * of 10,000 uids went round; 0.25-0.3 ms of a kworker's CPU a start, and 0.2 ms of the
 * attempt's own, here). A task that wants a session keyring it can use makes one
 * (KEYCTL_JOIN_SESSION_KEYRING, "keyctl session"). Root, its owner, may write it: the
 * child empties the uid's persistent keyring through it, as root (empty_persistent). */
#define KEYCTL_SETPERM 5
#define KEYCTL_UNLINK 9
#define KEY_POS_VIEW 0x01000000
#define KEY_USR_VIEW 0x00010000
#define KEY_USR_READ 0x00020000
#define KEY_USR_WRITE 0x00040000
#define KEY_USR_SEARCH 0x00080000
#define KEY_USR_LINK 0x00100000
#define SEALED (KEY_POS_VIEW | KEY_USR_VIEW | KEY_USR_READ | KEY_USR_WRITE | KEY_USR_SEARCH | KEY_USR_LINK)
static int sealed_keyring;
static void seal_keyring(void) {
    if (geteuid() != 0 || syscall(SYS_keyctl, KEYCTL_JOIN, NULL) < 0) return;
    sealed_keyring = syscall(SYS_keyctl, KEYCTL_SETPERM, KEYRING_SESSION, SEALED) == 0;
}
/* As root, under the sealed keyring: the uid's persistent keyring emptied. One empties
 * only a keyring it possesses (the uid owns it but may only see and read it), so it is
 * linked into the sealed keyring meanwhile (root may write there; the attempts that
 * possess it may not look inside). 0: done, or nothing there; -1: failed. */
static int empty_persistent(long uid) {
    long persistent = syscall(SYS_keyctl, KEYCTL_PERSISTENT, uid, KEYRING_SESSION);
    if (persistent < 0) return nothing_there() ? 0 : -1;
    int emptied = syscall(SYS_keyctl, KEYCTL_EMPTY, persistent) < 0 && !nothing_there() ? -1 : 0;
    if (syscall(SYS_keyctl, KEYCTL_UNLINK, persistent, KEYRING_SESSION) < 0) return -1;
    return emptied;
}
/* As the uid: its user and user-session keyrings emptied, and, with a session keyring of
 * its own (not sealed), its persistent one. */
static int empty_keyrings(int persistent_too) {
    if (syscall(SYS_keyctl, KEYCTL_EMPTY, KEYRING_USER) < 0 && !nothing_there()) return -1;
    if (syscall(SYS_keyctl, KEYCTL_EMPTY, KEYRING_USER_SESSION) < 0 && !nothing_there())
        return -1;
    if (!persistent_too) return 0;
    long persistent = syscall(SYS_keyctl, KEYCTL_PERSISTENT, -1, KEYRING_SESSION);
    if (persistent < 0) return nothing_there() ? 0 : -1;
    return syscall(SYS_keyctl, KEYCTL_EMPTY, persistent) < 0 && !nothing_there() ? -1 : 0;
}

/* A fresh network namespace has loopback, down: bring it up. */
static int loopback_up(void) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct ifreq request;
    memset(&request, 0, sizeof request);
    strncpy(request.ifr_name, "lo", IFNAMSIZ - 1);
    int rc = ioctl(fd, SIOCGIFFLAGS, &request);
    if (rc == 0) {
        request.ifr_flags |= IFF_UP;
        rc = ioctl(fd, SIOCSIFFLAGS, &request);
    }
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}

static int listed(const char *types, unsigned long type) {
    for (const char *at = types; at && *at; at = strchr(at, ',') ? strchr(at, ',') + 1 : NULL)
        if (strtoul(at, NULL, 16) == type) return 1;
    return 0;
}

static long long ns(struct timespec t) { return (long long)t.tv_sec * 1000000000LL + t.tv_nsec; }

/* Whether the file:// source, opened as the attempt, is the file of the agent's stamp;
 * errno says why not (ESTALE: another file, or changed). As root still: only the
 * filesystem ids are the attempt's, for the open alone, and read back. */
static int source_holds(struct request *r) {
    if (setgroups(0, NULL) < 0) return -1;
    uid_t uid = geteuid();
    gid_t gid = getegid();
    setfsgid((gid_t)r->gid);
    setfsuid((uid_t)r->uid);
    int fd = -1, saved = EPERM;
    if ((uid_t)setfsuid(-1) == (uid_t)r->uid && (gid_t)setfsgid(-1) == (gid_t)r->gid) {
        fd = open(r->source, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        saved = errno;
    }
    setfsuid(uid);
    setfsgid(gid);
    if ((uid_t)setfsuid(-1) != uid || (gid_t)setfsgid(-1) != gid)
        _exit(1);  /* a checker only: it dies unanswered (EIO), never serves with these ids */
    if (fd < 0) {
        errno = saved;
        return -1;
    }
    struct stat info;
    struct statfs fs;
    unsigned long long dev, ino, size;
    long long mtime, ctime;
    int same = fstat(fd, &info) == 0 && fstatfs(fd, &fs) == 0
               && sscanf(r->stamp, "%llu:%llu:%llu:%lld:%lld", &dev, &ino, &size, &mtime, &ctime) == 5
               && (unsigned long long)info.st_dev == dev && (unsigned long long)info.st_ino == ino
               && (unsigned long long)info.st_size == size && ns(info.st_mtim) == mtime
               && ns(info.st_ctim) == ctime && listed(r->fstypes, (unsigned long)fs.f_type);
    close(fd);
    if (!same) {
        errno = ESTALE;
        return -1;
    }
    return 0;
}

/* A start waiting for its source's check: its request (its own copy of it), descriptors
 * and the number of its reply; once its check began, its checker (pid, the socket or
 * pipe of its answer, resident or one-shot) and deadline. fd -1: not begun while a check
 * of the same path is pending (it begins once that one ends: EBUSY then if that one
 * hung, or while MAX_CHECKING checks run). The helper serves its other requests
 * meanwhile (main polls each answer, and wakes at the nearest deadline), so a check that
 * hangs holds back its own path only (and its slot: a checked start that finds none free
 * fails at once, EAGAIN, and the agent hands it back). MAX_PENDING is above what a burst
 * of starts of one path fills while they are checked one after another (100 starts sent
 * at once filled 32 and more), and bounds the slots: 128, each a parsed request (about
 * 66 KB: its argv and envp tables) and up to 3 descriptors. Each also keeps its request's
 * bytes, up to MAX_REQUEST (1 MB) each: 128 of the largest would hold 136 MB, so the
 * bytes the pending starts keep are bounded together too, PENDING_BYTES (16 MB: any one
 * request fits when none waits), past which a checked start fails at once, EAGAIN, as
 * when no slot is free. At worst 128 x 66 KB + 16 MB, about 25 MB. At most MAX_CHECKING
 * checks run at once (checker processes, polled answers). killed: its uid was killed
 * meanwhile, so it never starts. size: the bytes of its request it keeps. */
#define MAX_PENDING 128
#define PENDING_BYTES (16 << 20)
_Static_assert(PENDING_BYTES > MAX_REQUEST, "any one request fits when none waits");
#define MAX_CHECKING 32
static int checking;  /* checks running (begun, not ended) */
static size_t pending_bytes;  /* what the pending starts' requests keep, together */
struct pending {
    char *data;
    size_t size;
    struct request request;
    int fds[3], nfds, fd, resident, killed;
    int64_t seq;
    pid_t pid;
    long long deadline;
};
static struct pending *pending[MAX_PENDING];

/* Checkers of sources that did not answer in time (an open under a FUSE mount whose
 * server never replies waits in the kernel, and past the first waiter of a directory
 * not even SIGKILL ends it): their pids and paths, each sent SIGKILL and kept here
 * until it is gone, then reaped (a "clone" child, exit signal 0: reap's wait never sees
 * it). Nothing waits for one to die: each one's pidfd is polled in main beside the
 * socket (readable once it exited: reaped then, mostly within a millisecond of its
 * SIGKILL), and each request reaps those that ended (all there is without pidfds). A
 * check begins only while fewer than MAX_STUCK are kept; room for every running one
 * besides, each of which may yet hang. A path that could not be copied is kept as NULL:
 * that checker only counts. */
#define MAX_STUCK 8
#define STUCK_SLOTS (MAX_STUCK + MAX_CHECKING)
static struct { pid_t pid; int pidfd; char *path; } stuck[STUCK_SLOTS];
static int stuck_count;  /* kept (none, mostly: then no loop over stuck at all) */

static void reap_checkers(void) {
    for (int i = 0; i < STUCK_SLOTS && stuck_count; i++) {
        if (stuck[i].pid <= 0) continue;
        pid_t got = waitpid(stuck[i].pid, NULL, WNOHANG | __WCLONE);
        if (got == stuck[i].pid || (got < 0 && errno == ECHILD)) {  /* gone: its pidfd too */
            stuck[i].pid = 0;
            if (stuck[i].pidfd >= 0) close(stuck[i].pidfd);
            stuck[i].pidfd = -1;
            free(stuck[i].path);
            stuck[i].path = NULL;
            stuck_count--;
        }
    }
}

/* A checker that did not answer in time: SIGKILL, which ends a wait for a request the
 * server has not read yet at once, and kept until it is gone (reap_checkers). */
static void let_go(pid_t pid, const char *path) {
    kill(pid, SIGKILL);
    for (int i = 0; i < STUCK_SLOTS; i++)
        if (stuck[i].pid <= 0) {  /* always one: see stuck */
            stuck[i].pid = pid;
            stuck[i].pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
            stuck[i].path = strdup(path);
            stuck_count++;
            break;
        }
}

static int64_t hung(void) { return stuck_count; }

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* The resident checker: a copy of this process made before it joins its cgroups (so it
 * lives outside the slot, and counts in none of its figures), which answers each check
 * on a SOCK_SEQPACKET socket: "uid gid stamp types", a NUL, the path; the reply, an int
 * errno (0: it holds). -1 once it hung or died (then killed, and reaped or kept in stuck).
 * A process that joined no cgroup (cgroup v2, or none: its attempts are cloned into their
 * own) makes a new one at its next check, which would be born where the first was
 * (restartable); one that joined a v1 slot would have it born in the slot, where it
 * would count in the slot's figures and never leave it alone: there each check is a
 * one-shot copy of this process instead (reaped before the attempt starts). */
static int resident_fd = -1, resident_busy = 0;  /* busy: a check of its is pending */
static pid_t resident_pid = 0;
static int restartable = 0;
#define MAX_CHECK (PATH_MAX + 512)

/* In a checker: keep only fd (as 3) of what this process holds. */
static void only(int fd) {
    if (fd != 3 && dup3(fd, 3, O_CLOEXEC) < 0) _exit(1);
    if (syscall(SYS_close_range, 4, ~0U, 0) < 0)
        for (int other = 4; other < 65536; other++) close(other);
}

static void start_resident(void) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0) return;
    struct clone_args args;
    memset(&args, 0, sizeof args);  /* exit signal 0: reap's wait never sees it */
    pid_t pid = (pid_t)syscall(SYS_clone3, &args, sizeof args);
    if (pid == 0) {
        static char check[MAX_CHECK + 1];
        static char stamp[128], types[256];
        only(pair[1]);
        for (;;) {
            ssize_t size = recv(3, check, MAX_CHECK, 0);
            if (size <= 0) _exit(0);  /* this process is gone */
            check[size] = '\0';
            struct request r;
            memset(&r, 0, sizeof r);
            int err = EINVAL;
            size_t head = strlen(check);
            if (head + 1 < (size_t)size
                && sscanf(check, "%ld %ld %127s %255s", &r.uid, &r.gid, stamp, types) == 4) {
                r.stamp = stamp;
                r.fstypes = types;
                r.source = check + head + 1;
                err = source_holds(&r) < 0 ? errno : 0;
            }
            if (send(3, &err, sizeof err, MSG_NOSIGNAL) < 0) _exit(0);
        }
    }
    close(pair[1]);
    if (pid < 0) {
        close(pair[0]);
        return;
    }
    resident_fd = pair[0];
    resident_pid = pid;
}

/* The check handed to the resident checker; its socket, or -1 if there is none or it
 * is busy with another check. */
static int ask_resident(struct request *r) {
    static char check[MAX_CHECK + 1];
    if (resident_busy) return -1;
    if (resident_fd < 0 && restartable) start_resident();
    if (resident_fd < 0) return -1;
    int head = snprintf(check, sizeof check, "%ld %ld %s %s", r->uid, r->gid, r->stamp, r->fstypes);
    size_t path = strlen(r->source);
    if (head < 0 || (size_t)head + 1 + path > MAX_CHECK) return -1;
    memcpy(check + head + 1, r->source, path);
    if (send(resident_fd, check, (size_t)head + 1 + path, MSG_NOSIGNAL) < 0) {
        close(resident_fd);  /* it exited (its end closed): reaped */
        resident_fd = -1;
        kill(resident_pid, SIGKILL);
        while (waitpid(resident_pid, NULL, __WCLONE) < 0 && errno == EINTR) {}
        return -1;
    }
    return resident_fd;
}

/* A one-shot checker: a copy of this process that checks, answers and exits. */
static pid_t one_shot(struct request *r, int *answer_fd) {
    int answer[2];
    if (pipe2(answer, O_CLOEXEC) < 0) return -1;
    struct clone_args args;
    memset(&args, 0, sizeof args);
    pid_t pid = (pid_t)syscall(SYS_clone3, &args, sizeof args);
    if (pid == 0) {
        only(answer[1]);
        int err = source_holds(r) < 0 ? errno : 0;
        _exit(write(3, &err, sizeof err) == (ssize_t)sizeof err ? 0 : 1);
    }
    int saved = errno;
    close(answer[1]);
    if (pid < 0) {
        close(answer[0]);
        errno = saved;
        return -1;
    }
    *answer_fd = answer[0];
    return pid;
}

/* source_holds, bounded: by the resident checker (or a one-shot one while the resident
 * is busy with another check, or where there is none), waited for at most r->source_ms.
 * begin_check starts it: 0 (begun, or to begin after a pending check of the same path,
 * or once fewer than MAX_CHECKING checks run: go_on),
 * or the errno of a start that fails at once: EBUSY if a checker of this same path
 * still hangs, and the checking's own faults, which say nothing of this path: EAGAIN if
 * MAX_STUCK checkers (of any paths) still hang, clone's errno if none could be made.
 * end_check takes its answer (readable) or gives up on it (its deadline passed): 0 if
 * the source holds, else an errno: the check's, ETIMEDOUT if it did not answer in time
 * (the checker then sent SIGKILL and kept in stuck until it is gone, however soon:
 * this process waits for no checker to die, and until it is reaped a start of its path
 * fails with EBUSY and it counts among the MAX_STUCK), EIO if the checker died
 * unanswered. This process never waits on a file system: it goes on serving. */
static int begin_check(struct pending *p) {
    struct request *r = &p->request;
    for (int i = 0; i < STUCK_SLOTS; i++)
        if (stuck[i].pid > 0 && stuck[i].path && strcmp(stuck[i].path, r->source) == 0)
            return EBUSY;
    if (hung() >= MAX_STUCK) return EAGAIN;
    if (checking >= MAX_CHECKING) return 0;
    for (int i = 0; i < MAX_PENDING; i++)
        if (pending[i] && pending[i]->fd >= 0 && strcmp(pending[i]->request.source, r->source) == 0)
            return 0;
    int fd = ask_resident(r);  /* it may make a new resident: its pid read after */
    pid_t pid = resident_pid;
    if (fd < 0 && (pid = one_shot(r, &fd)) < 0) return errno;
    p->fd = fd;
    p->pid = pid;
    p->resident = fd == resident_fd;
    resident_busy |= p->resident;
    p->deadline = now_ms() + r->source_ms;
    checking++;
    return 0;
}

static int end_check(struct pending *p, int readable) {
    int err = 0, fd = p->fd;
    ssize_t got = -1;
    p->fd = -1;
    checking--;
    if (readable) {
        do got = read(fd, &err, sizeof err);
        while (got < 0 && errno == EINTR);
    }
    if (p->resident) resident_busy = 0;
    if (got == (ssize_t)sizeof err) {
        if (!p->resident) {
            close(fd);
            while (waitpid(p->pid, NULL, __WCLONE) < 0 && errno == EINTR) {}
        }
        return err;
    }
    close(fd);
    if (p->resident) resident_fd = -1;  /* a new one (or one-shot checkers) from now on */
    if (got == 0) {  /* it died unanswered (its end closed: exiting) */
        kill(p->pid, SIGKILL);
        while (waitpid(p->pid, NULL, __WCLONE) < 0 && errno == EINTR) {}
        return EIO;
    }
    /* No answer in time: killed and kept until it is gone, not waited for. */
    let_go(p->pid, p->request.source);
    return ETIMEDOUT;
}
/* In the child: become the attempt, then exec it. Never returns. */
static void become(struct request *r, int status_fd) {
    /* A group of its own, not a session: in a cpu cgroup (v1 here) a setsid() here (it
     * makes a scheduler autogroup) kept this process's clone from returning about 1 ms
     * after the exec (the task ran meanwhile; its reply, and the next request, waited).
     * The session is this process's, which has no controlling terminal (main), and one
     * who is not a session's leader cannot take one; the task may setsid() itself. */
    if (setpgid(0, 0) < 0) fail(status_fd, SESSION);
    if (r->tmp || r->mount_at || r->bind_from) {
        if (unshare(CLONE_NEWNS) < 0) fail(status_fd, MOUNTS);
        if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) fail(status_fd, MOUNTS);
        if (r->mount_at && syscall(SYS_move_mount, r->mount_fd, "", AT_FDCWD, r->mount_at,
                                   MOVE_MOUNT_F_EMPTY_PATH) < 0)
            fail(status_fd, MOUNTS);
        if (r->bind_from && mount(r->bind_from, r->exe, NULL, MS_BIND, NULL) < 0)
            fail(status_fd, MOUNTS);
        /* A world-writable folder gone (or no longer a folder) since the agent looked
         * for them has nothing to share: skipped, not every attempt failed for it. */
        for (int i = 0; i < r->ntargets; i++)
            if (mount(r->tmp, r->targets[i], NULL, MS_BIND, NULL) < 0
                && errno != ENOENT && errno != ENOTDIR)
                fail(status_fd, MOUNTS);
        if (r->shm && mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV,
                            "mode=1777,size=64m") < 0)
            fail(status_fd, MOUNTS);
    }
    if (r->netns && (unshare(CLONE_NEWNET) < 0 || loopback_up() < 0)) fail(status_fd, NETWORK);
    if (r->ipc && unshare(CLONE_NEWIPC) < 0) fail(status_fd, IPC);
    for (int i = 0; i < r->nlimits; i++) {
        struct rlimit limit = {r->limit_value[i], r->limit_value[i]};
        if (setrlimit(r->limit_which[i], &limit) < 0) fail(status_fd, LIMITS);
    }
    if (r->uid >= 0) {
        int keyrings = sealed_keyring ? empty_persistent(r->uid) : join_keyring();
        if (keyrings < 0) fail(status_fd, KEYRINGS);
        if (setgroups(0, NULL) < 0) fail(status_fd, IDENTITY);
        if (setresgid(r->gid, r->gid, r->gid) < 0) fail(status_fd, IDENTITY);
        if (setresuid(r->uid, r->uid, r->uid) < 0) fail(status_fd, IDENTITY);
        if (keyrings == 0 && empty_keyrings(!sealed_keyring) < 0) fail(status_fd, KEYRINGS);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail(status_fd, PRIVS);
    umask(077);
    if (r->dir && chdir(r->dir) < 0) fail(status_fd, WORKDIR);
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null < 0) fail(status_fd, DESCRIPTORS);
    /* Descriptors 0-2 come from null and the log, the status pipe goes to 3; they are
     * moved above 3 first so that no dup2 overwrites one still needed. */
    int log_fd = fcntl(r->log_fd, F_DUPFD_CLOEXEC, 10);
    int status = fcntl(status_fd, F_DUPFD_CLOEXEC, 10);
    if (log_fd < 0 || status < 0) fail(status_fd, DESCRIPTORS);
    status_fd = status;
    if (dup2(null, 0) < 0 || dup2(log_fd, 1) < 0 || dup2(log_fd, 2) < 0) fail(status_fd, DESCRIPTORS);
    if (dup3(status_fd, 3, O_CLOEXEC) < 0) fail(status_fd, DESCRIPTORS);
    status_fd = 3;
    if (syscall(SYS_close_range, 4, ~0U, 0) < 0) {
        for (int fd = 4; fd < 65536; fd++) close(fd);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    r->argv[r->argc] = NULL;
    r->envp[r->envc] = NULL;
    execve(r->exe, r->argv, r->envp);
    fail(status_fd, EXEC);
}

/* What the child needs, for a child that shares this process's memory until its exec. */
struct child { struct request *request; int sock, status_read, status_write; };

/* The stack of a child started with CLONE_VM: one at a time (CLONE_VFORK holds this
 * process until the child has exec'd or exited). */
static char child_stack[256 * 1024] __attribute__((aligned(16)));

static int child_main(void *arg) {
    struct child *c = arg;
    close(c->sock);
    close(c->status_read);
    become(c->request, c->status_write);
    return 127;
}

/* Start the child; its pid, or -1. Into a cgroup v2 folder: clone3 CLONE_INTO_CGROUP,
 * a copy of this process (fork semantics). Else CLONE_VM | CLONE_VFORK, as posix_spawn
 * does: no page tables copied for a child that is about to exec, and none to tear down at
 * its exec; the child runs on its own stack, changes only its own descriptors (no
 * CLONE_FILES), credentials and signal mask, and this process waits meanwhile. */
static pid_t start(struct child *c) {
    struct request *r = c->request;
    if (r->has_cgroup) {
        struct clone_args args;
        memset(&args, 0, sizeof args);
        args.flags = CLONE_INTO_CGROUP;
        args.exit_signal = SIGCHLD;
        args.cgroup = (uint64_t)r->cgroup_fd;
        pid_t pid = (pid_t)syscall(SYS_clone3, &args, sizeof args);
        if (pid == 0) _exit(child_main(c));
        return pid;
    }
    return clone(child_main, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, c);
}

/* The log descriptor of each attempt started and not yet reaped, a copy held until the
 * moment its exit record is sent (closed right before, so that no copy is left once the
 * agent has the record): the log pipe then ends with the record, not at the attempt's
 * exit, so the agent's one wake-up mostly finds both (it was woken twice, for the pipe's
 * end and then, once this process had been woken and had reaped the attempt, for the
 * record). At most held_max (a part of the descriptor limit, set in main): past it a log
 * is not held, and its pipe ends as the attempt exits, as before. */
#define MAX_HELD 4096
static struct { pid_t pid; int fd; } held[MAX_HELD];
static int held_count, held_max;

static void hold_log(pid_t pid, int log_fd) {
    if (held_count >= held_max) return;
    int copy = fcntl(log_fd, F_DUPFD_CLOEXEC, 3);
    if (copy < 0) return;
    held[held_count].pid = pid;
    held[held_count].fd = copy;
    held_count++;
}

/* The held log descriptor of pid, let go of (-1: none). */
static int release_log(pid_t pid) {
    for (int i = 0; i < held_count; i++)
        if (held[i].pid == pid) {
            int fd = held[i].fd;
            held[i] = held[--held_count];
            return fd;
        }
    return -1;
}

static void close_all(int *fds, int *count) {
    for (int i = 0; i < *count; i++) close(fds[i]);
    *count = 0;
}

/* Reap every attempt that ended, its process group killed first (while the leader is an
 * unreaped zombie its pid, the group's id, cannot be reused), and send their records in
 * one message per MAX_EXITS. Returns -1 if the agent is gone. */
static int reap(int sock) {
    static struct exits batch;
    static int logs[MAX_EXITS];  /* held logs, closed as their records are sent */
    int nlogs = 0;
    batch.kind = EXITS;
    batch.count = 0;
    for (;;) {
        siginfo_t info;
        memset(&info, 0, sizeof info);
        if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) < 0 || info.si_pid == 0) break;
        pid_t pid = info.si_pid;
        kill(-pid, SIGKILL);
        int status = 0;
        struct rusage usage;
        memset(&usage, 0, sizeof usage);
        if (wait4(pid, &status, 0, &usage) != pid) break;
        struct exit_record *record = &batch.records[batch.count++];
        record->pid = pid;
        record->status = status;
        record->utime_us = (int64_t)usage.ru_utime.tv_sec * 1000000 + usage.ru_utime.tv_usec;
        record->stime_us = (int64_t)usage.ru_stime.tv_sec * 1000000 + usage.ru_stime.tv_usec;
        record->maxrss_kb = usage.ru_maxrss;
        read_counters(record);
        int log_fd = release_log(pid);
        if (log_fd >= 0) logs[nlogs++] = log_fd;
        if (batch.count == MAX_EXITS) {
            close_all(logs, &nlogs);
            if (send(sock, &batch, sizeof batch, MSG_NOSIGNAL) < 0) return -1;
            batch.count = 0;
        }
    }
    if (batch.count == 0) return 0;
    size_t size = offsetof(struct exits, records) + batch.count * sizeof(struct exit_record);
    close_all(logs, &nlogs);
    return send(sock, &batch, size, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

/* Signal an attempt's process group, only while its leader is our child not yet reaped
 * (once reaped, its pid may belong to another process). */
static void signal_attempt(pid_t pid, int signum) {
    siginfo_t info;
    memset(&info, 0, sizeof info);
    if (pid > 0 && waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0) kill(-pid, signum);
}

static void kill_uid(long uid, struct reply *reply) {
    /* A child of ours drops to the uid and sends kill -9 -1: the kernel signals exactly
     * the processes that uid may signal, which are its own. The kernel walks every
     * process under the lock that fork takes to add one, and a process with SIGKILL
     * pending cannot fork, so one pass leaves nothing behind; a second costs little. */
    pid_t pid = fork();
    if (pid == 0) {
        if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0)
            _exit(2);
        for (int round = 0; round < 2; round++)
            if (kill(-1, SIGKILL) < 0 && errno != ESRCH) _exit(1);
        _exit(0);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) < 0) {
        reply->err = errno;
        return;
    }
    reply->err = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A counter file beside a joined cgroup.procs, opened once if it is there. */
static void open_counter(int *fd, const char *procs, const char *name, int flags) {
    char path[4096];
    const char *slash = strrchr(procs, '/');
    if (*fd >= 0 || !slash) return;
    int length = snprintf(path, sizeof path, "%.*s/%s", (int)(slash - procs), procs, name);
    if (length > 0 && length < (int)sizeof path) *fd = open(path, flags | O_CLOEXEC);
}

static void join(char **procs, int count) {
    char pid[32];
    int length = snprintf(pid, sizeof pid, "%d", getpid());
    for (int i = 0; i < count; i++) {
        int fd = open(procs[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, length) != length) {
            perror(procs[i]);
            exit(3);
        }
        close(fd);
        open_counter(&peak_fd, procs[i], "memory.max_usage_in_bytes", O_RDWR);
        open_counter(&oom_fd, procs[i], "memory.oom_control", O_RDONLY);
        open_counter(&cpu_fd, procs[i], "cpuacct.usage", O_RDWR);
        open_counter(&pids_fd, procs[i], "pids.current", O_RDONLY);
        open_counter(&quota_fd, procs[i], "cpu.cfs_quota_us", O_WRONLY);
    }
}

/* The attempt's own CPU quota, once it has exec'd: what ran before (this process's clone,
 * the child's namespaces, keyrings and identity) is Cairn's work, done on the budget the
 * agent wrote before the start (a period's worth of every CPU), not the attempt's. Charged
 * to a small quota (10 ms a second), a start held up there (a spin lock's holder preempted
 * on the host) overran it and held the attempt throttled for seconds before its first
 * instruction. The attempt runs on that budget only from its exec until this process
 * runs again (its exec closed the status pipe this process reads): microseconds on an idle
 * host, up to a scheduler slice (milliseconds) on a busy one, and what it spends then is
 * not charged (the write refills the period). If the quota cannot be written the attempt
 * is killed and reaped here (errno kept): it never runs on without its limit. */
static int apply_quota(pid_t pid, const struct request *r) {
    size_t length = strlen(r->quota);
    int fd = r->has_cgroup ? openat(r->cgroup_fd, "cpu.max", O_WRONLY | O_CLOEXEC) : quota_fd;
    int err = fd < 0 ? (r->has_cgroup ? errno : ENOENT) : 0;
    if (fd >= 0) {
        ssize_t wrote = pwrite(fd, r->quota, length, 0);
        if (wrote != (ssize_t)length) err = wrote < 0 ? errno : EIO;
        if (r->has_cgroup) close(fd);
    }
    if (!err) return 0;
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
    errno = err;
    return -1;
}

/* A start's reply, numbered seq: the attempt started, unless its source check said why
 * not (unsound: an errno). Returns -1 if the agent is gone. */
static int answer_start(int sock, struct request *request, int unsound, int64_t seq) {
    struct reply reply = {REPLY, 0, OK, 0, -1, 0, seq};
    int pipe_fds[2];
    if (unsound) {
        reply.step = SOURCE;
        reply.err = unsound;
    } else if (pipe2(pipe_fds, O_CLOEXEC) < 0) {
        reply.step = CLONE;
        reply.err = errno;
    } else {
        struct child child = {request, sock, pipe_fds[0], pipe_fds[1]};
        reset_counters();
        reply.oom_base = oom_base;
        pid_t pid = start(&child);
        close(pipe_fds[1]);
        if (pid < 0) {
            reply.step = CLONE;
            reply.err = errno;
        } else {
            struct reply failed;
            ssize_t got;
            do got = read(pipe_fds[0], &failed, sizeof failed);
            while (got < 0 && errno == EINTR);
            reply.pid = pid;
            if (got == (ssize_t)sizeof failed) {
                reply.step = failed.step;
                reply.err = failed.err;
                /* It exits right after saying so: reaped here, no exit record. */
                while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
            } else if (request->quota && apply_quota(pid, request) < 0) {
                reply.step = CPU_QUOTA;
                reply.err = errno;
            } else {
                hold_log(pid, request->log_fd);
            }
        }
        close(pipe_fds[0]);
    }
    reply.hung = hung();
    return send(sock, &reply, sizeof reply, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

/* The pending start in slot i, answered (its check ended: err) and let go; one whose uid
 * was killed meanwhile (killed) never starts: it fails as its check says, or with
 * ECANCELED if its source held. */
static int answer_pending(int sock, int i, int err) {
    struct pending *p = pending[i];
    int rc = answer_start(sock, &p->request, err || !p->killed ? err : ECANCELED, p->seq);
    for (int k = 0; k < p->nfds; k++) close(p->fds[k]);
    pending_bytes -= p->size;
    free(p->data);
    free(p);
    pending[i] = NULL;
    return rc;
}

/* A kill of a uid: the pending starts of that uid are cancelled first (a start after
 * the kill would outlive it): one whose check has not begun fails at once (ECANCELED),
 * one whose check runs is marked, and never starts when its check ends (answer_pending);
 * then every process of the uid is killed, and the kill answered at once. Nothing waits:
 * the uid may be handed to another attempt as soon as the kill is answered, and that
 * attempt's starts, sent after the kill, are not cancelled. Returns -1 if the agent is
 * gone. */
static int answer_kill(int sock, long uid, int64_t seq) {
    for (int i = 0; i < MAX_PENDING; i++)
        if (pending[i] && pending[i]->request.uid == uid) {
            pending[i]->killed = 1;
            if (pending[i]->fd < 0 && answer_pending(sock, i, ECANCELED) < 0) return -1;
        }
    struct reply reply = {REPLY, 0, OK, 0, -1, 0, seq};
    kill_uid(uid, &reply);
    reply.hung = hung();
    return send(sock, &reply, sizeof reply, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

/* A check of checked's path did not answer in time: the starts that waited for it fail
 * at once with EBUSY (an earlier check of their path hung), whether or not its checker
 * could be reaped. Without this, where a SIGKILL ends a hung checker (NFS, a FUSE server
 * that never read the request), each of them would begin its own check and wait its
 * own full limit after the one before it: N starts of a hung path, N limits, with their
 * pending slots (and every other checked start, once MAX_PENDING wait) held all along.
 * Returns -1 if the agent is gone. */
static int hung_path(int sock, struct pending *checked) {
    for (int i = 0; i < MAX_PENDING; i++)
        if (pending[i] && pending[i] != checked && pending[i]->fd < 0
            && strcmp(pending[i]->request.source, checked->request.source) == 0
            && answer_pending(sock, i, EBUSY) < 0)
            return -1;
    return 0;
}

/* After a check ended: the starts waiting for a check of their path begin (or fail at
 * once). */
static int go_on(int sock) {
    reap_checkers();
    for (int i = 0; i < MAX_PENDING; i++) {
        int err = pending[i] && pending[i]->fd < 0 ? begin_check(pending[i]) : 0;
        if (err && answer_pending(sock, i, err) < 0) return -1;
    }
    return 0;
}

/* A start whose source is checked first: pending (with its own copy of the request)
 * while the check runs; answered at once if it cannot begin, or cannot be kept: EAGAIN
 * while MAX_PENDING starts are pending already, or their requests would keep more than
 * PENDING_BYTES with this one's (the agent hands it back, as it does a start while too
 * many checkers hang: the checking's fault, not the source's), ENOMEM. Returns -1 if
 * the agent is gone. */
static int check_first(int sock, struct request *parsed, ssize_t size, int *fds, int nfds,
                       int64_t seq) {
    int slot = -1;
    for (int i = MAX_PENDING - 1; i >= 0; i--)
        if (!pending[i]) slot = i;
    int full = slot < 0 || pending_bytes + (size_t)size + 1 > PENDING_BYTES;
    struct pending *p = full ? NULL : malloc(sizeof *p);
    char *data = p ? malloc((size_t)size + 1) : NULL;
    if (!data) {
        free(p);
        int rc = answer_start(sock, parsed, full ? EAGAIN : ENOMEM, seq);
        for (int i = 0; i < nfds; i++) close(fds[i]);
        return rc;
    }
    memcpy(data, buffer, (size_t)size + 1);
    p->size = (size_t)size + 1;
    pending_bytes += p->size;
    parse(data, (size_t)size, &p->request);  /* the same fields, parsed once already */
    p->request.log_fd = parsed->log_fd;
    p->request.cgroup_fd = parsed->cgroup_fd;
    p->request.mount_fd = parsed->mount_fd;
    p->data = data;
    memcpy(p->fds, fds, sizeof p->fds);
    p->nfds = nfds;
    p->seq = seq;
    p->fd = -1;
    p->resident = 0;
    p->killed = 0;
    p->pid = 0;
    pending[slot] = p;
    int err = begin_check(p);
    return err ? answer_pending(sock, slot, err) : 0;
}
/* One request: spawn (a reply, later if its source is checked: answer_pending), kill a
 * uid (a reply), count the hung checkers (a reply), or signal an attempt (none). Each
 * reply carries its request's number (seq: 1 for the first request that has a reply).
 * Returns -1 if the agent is gone. */
static int serve(int sock) {
    static int64_t served;
    char control[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {buffer, sizeof buffer - 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                         .msg_control = control, .msg_controllen = sizeof control};
    ssize_t size = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (size < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
    if (size <= 0) return -1;
    buffer[size] = '\0';
    int fds[3] = {-1, -1, -1}, nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            if (nfds > 3) nfds = 3;
            memcpy(fds, CMSG_DATA(c), nfds * sizeof(int));
        }
    }
    struct reply reply = {REPLY, 0, OK, 0, -1, 0, 0};
    struct request request;
    reap_checkers();  /* none, mostly: then no system call */
    if (buffer[0] == 'S') {
        char *rest;
        long pid = strtol(buffer + 1, &rest, 10);
        signal_attempt((pid_t)pid, (int)strtol(rest + (*rest == ' '), NULL, 10));
        for (int i = 0; i < nfds; i++) close(fds[i]);
        return 0;
    }
    reply.seq = ++served;
    if (buffer[0] == 'k') {
        /* An attempt's uid only: the killer of uid 0, root still, and of what is no uid
         * (-1: setresuid leaves the ids as they are) would SIGKILL every process there is. */
        long uid = 0;
        if (parse_id(buffer + 1, &uid) == 0 && uid > 0) {
            for (int i = 0; i < nfds; i++) close(fds[i]);
            return answer_kill(sock, uid, reply.seq);
        }
        reply.err = EINVAL;
    } else if (buffer[0] == 'h') {
        /* reaped above, counted below */
    } else if (parse(buffer, (size_t)size, &request) < 0
               || nfds != 1 + request.has_cgroup + (request.mount_at != NULL)) {
        reply.step = CLONE;
        reply.err = EINVAL;
    } else {
        request.log_fd = fds[0];
        request.cgroup_fd = request.has_cgroup ? fds[1] : -1;
        request.mount_fd = request.mount_at ? fds[1 + request.has_cgroup] : -1;
        if (request.source) return check_first(sock, &request, size, fds, nfds, reply.seq);
        int rc = answer_start(sock, &request, 0, reply.seq);
        for (int i = 0; i < nfds; i++) close(fds[i]);
        return rc;
    }
    for (int i = 0; i < nfds; i++) close(fds[i]);
    reply.hung = hung();
    return send(sock, &reply, sizeof reply, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

int main(int argc, char **argv) {
    if (argc < 3 || strcmp(argv[1], "zygote") != 0) {
        fprintf(stderr, "usage: cairn-spawn zygote FD [CGROUP_PROCS...]\n");
        return 2;
    }
    int sock = atoi(argv[2]);
    fcntl(sock, F_SETFD, FD_CLOEXEC);
    /* A session of its own, so that no controlling terminal of the agent's reaches its
     * attempts (each starts in a process group of its own in it: become). */
    if (setsid() < 0) {
        perror("setsid");
        return 3;
    }
    struct rlimit files;
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
        /* Half of what is left past a margin for requests' descriptors and checks. */
        long spare = ((long)files.rlim_cur - 256) / 2;
        held_max = spare < 0 ? 0 : spare > MAX_HELD ? MAX_HELD : (int)spare;
    } else {
        held_max = MAX_HELD;
    }
    seal_keyring();  /* before the resident checker: it inherits the sealed one too */
    start_resident();  /* before the join: outside the slot */
    restartable = argc == 3;  /* no slot to join: a new one is born where the first was */
    join(argv + 3, argc - 3);
    /* Exits arrive on a signalfd, beside the requests: SIGCHLD is blocked here (each
     * child unblocks every signal before its exec). */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, NULL) < 0) return 1;
    int exited = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    if (exited < 0) return 1;
    /* Its last field, flags: it keeps its slot's counters (1), it can write its slot's
     * CPU quota after each exec (2). */
    int keeps = (peak_fd >= 0 && cpu_fd >= 0 && oom_fd >= 0 ? 1 : 0) | (quota_fd >= 0 ? 2 : 0);
    struct reply ready = {REPLY, getpid(), OK, 0, keeps, 0, 0};
    if (send(sock, &ready, sizeof ready, MSG_NOSIGNAL) < 0) return 1;
    for (;;) {
        /* The requests (always), the exits, each pending check's answer until its
         * deadline, and the end of each checker let go (its pidfd). */
        struct pollfd ready_fds[2 + MAX_CHECKING + STUCK_SLOTS] = {{sock, POLLIN, 0},
                                                                   {exited, POLLIN, 0}};
        int slots[MAX_CHECKING], n = 2, timeout = -1;
        long long now = now_ms();
        for (int i = 0; i < MAX_PENDING && n - 2 < checking; i++) {
            if (pending[i] && pending[i]->fd >= 0) {
                long long left = pending[i]->deadline - now;
                left = left < 0 ? 0 : left;
                timeout = timeout < 0 || left < timeout ? (int)left : timeout;
                slots[n - 2] = i;
                ready_fds[n++] = (struct pollfd){pending[i]->fd, POLLIN, 0};
            }
        }
        int checks = n;
        for (int i = 0; i < STUCK_SLOTS && stuck_count; i++)
            if (stuck[i].pid > 0 && stuck[i].pidfd >= 0)
                ready_fds[n++] = (struct pollfd){stuck[i].pidfd, POLLIN, 0};
        if (poll(ready_fds, n, timeout) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (ready_fds[1].revents) {
            struct signalfd_siginfo info;
            while (read(exited, &info, sizeof info) == (ssize_t)sizeof info) {}
            if (reap(sock) < 0) return 1;
        }
        for (int k = checks; k < n; k++)
            if (ready_fds[k].revents) {
                reap_checkers();
                break;
            }
        now = now_ms();
        int ended = 0;
        for (int k = 2; k < checks; k++) {
            struct pending *p = pending[slots[k - 2]];
            if (!ready_fds[k].revents && p->deadline > now) continue;
            ended = 1;
            int err = end_check(p, ready_fds[k].revents != 0);
            if (err == ETIMEDOUT && hung_path(sock, p) < 0) return 0;
            if (answer_pending(sock, slots[k - 2], err) < 0) return 0;
        }
        if (ended && go_on(sock) < 0) return 0;
        if (ready_fds[0].revents && serve(sock) < 0) return 0;
    }
}
