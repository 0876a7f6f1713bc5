/* The floor under an isolated attempt start: what a bare isolated spawn of a program
 * needs, done N times by a small C process, with none of Cairn's bookkeeping.
 *
 *   floor [-n N] [-j J] [-u UID] [-c CGROUP_PROCS_FILE]... [-s] -- PROGRAM [ARG]...
 *
 * Each spawn: a child sharing this process's memory until its exec (clone with CLONE_VM
 * | CLONE_VFORK on a stack of its own, as posix_spawn and Cairn's helper start attempts:
 * no page tables copied; about 0.1 ms less a spawn than fork); in the child a new mount namespace (unshare, "/" made private, a
 * fresh tmpfs on /tmp), setgroups/setresgid/setresuid to UID, stdin and stdout on
 * /dev/null, exec PROGRAM; the parent reaps it with wait4. On cgroup v1 the process
 * joins the given pooled slot once (a cgroup.procs file per hierarchy, folders made by
 * the caller) before the loop, so every spawn is born inside it, as Cairn's pool does.
 * -j runs J such loops at once (N spread over them), to fill the machine's cores.
 * Steps that need root are skipped without it and named on the "skipped" line.
 *
 * -s DIR adds the parts of the sandbox Cairn gives every attempt (the agent's tmpfs.make and
 * workdirs, the helper's spawn.c become) that the bare spawn has not, so that an attempt's
 * own process can be put beside the same sandbox with none of Cairn's bookkeeping. DIR is
 * a folder the caller made, reachable by UID, holding an empty folder "home" and an empty
 * file "program". Before each clone the loop makes a detached tmpfs (fsopen, fsconfig,
 * fsmount: its root 0700 UID's, a "tmp" folder in it, as the agent does) and closes it after
 * the reap. In the child: a process group of its own; the mount namespace with that tmpfs
 * attached on DIR/home (move_mount), PROGRAM bound on DIR/program, the tmpfs's tmp bound on
 * each -t TARGET (one gone is skipped) and a fresh tmpfs on /dev/shm instead of the bare
 * spawn's tmpfs on /tmp; an IPC namespace; RLIMIT_CORE 0; the uid's persistent keyring
 * emptied as root through the loop's sealed session keyring (each loop joins and seals one
 * at its start, as a helper does) and its user and user-session keyrings as the uid;
 * no_new_privs, umask 077, the home as working folder, descriptors from 3 closed, the
 * signal mask cleared; exec of DIR/program. Without root only the process group,
 * RLIMIT_CORE and what follows the uid are done. A step that fails exits with its own
 * status (126-139), which the loop reports.
 *
 * Prints key=value lines: spawns, cpu_us (its own and its reaped descendants' rusage,
 * user + system, over the loops), child_cpu_us (the spawned children's alone, from their
 * wait4: each one's clone to its exec, and the program), wall_us (the loops' elapsed
 * time), skipped, and with -j 1 walls_us (each spawn's clone-to-reaped time,
 * comma-separated).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_CGROUPS 16

static const char *procs[MAX_CGROUPS];
static int nprocs;
static int as_root;
static uid_t uid = 65534;
static const char *sandbox; /* -s DIR */
static const char *targets[MAX_CGROUPS]; /* -t */
static int ntargets, keyrings;
static char home[4096], placeholder[4096];

#define KEYCTL_JOIN 1
#define KEYCTL_SETPERM 5
#define KEYCTL_EMPTY 7
#define KEYCTL_UNLINK 9
#define KEYCTL_PERSISTENT 22
#define KEYRING_SESSION (-3)
#define KEYRING_USER (-4)
#define KEYRING_USER_SESSION (-5)
/* As spawn.c's SEALED: possessors view; the owner (root) views, reads, writes, searches,
 * links. */
#define SEALED (0x01000000 | 0x00010000 | 0x00020000 | 0x00040000 | 0x00080000 | 0x00100000)
/* The new mount API (the same numbers on every architecture), as tmpfs.py calls it. */
#define NR_MOVE_MOUNT 429
#define NR_FSOPEN 430
#define NR_FSCONFIG 431
#define NR_FSMOUNT 432
#define HOME_FSCONFIG_SET_STRING 1
#define HOME_FSCONFIG_CMD_CREATE 6
#define HOME_MOUNT_ATTR_NOSUID 0x2
#define HOME_MOUNT_ATTR_NODEV 0x4
#define HOME_MOVE_MOUNT_F_EMPTY_PATH 0x4

static long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static long long cpu_us(int who) {
    struct rusage r;
    getrusage(who, &r);
    return (long long)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000 + r.ru_utime.tv_usec
           + r.ru_stime.tv_usec;
}

static void die(const char *what) {
    fprintf(stderr, "floor: %s: %s\n", what, strerror(errno));
    exit(2);
}

static void join_slot(void) {
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%d", (int)getpid());
    for (int i = 0; i < nprocs; i++) {
        int fd = open(procs[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, (size_t)len) != len) die(procs[i]);
        close(fd);
    }
}

/* As spawn.c's: keyctl answers that mean there is nothing to empty. */
static int nothing_there(void) {
    return errno == ENOSYS || errno == EOPNOTSUPP || errno == EDQUOT;
}

/* -s: a loop joins a session keyring of its own and seals it, as a helper does at its
 * start; 0 if keyctl refuses. */
static int seal_keyring(void) {
    return syscall(SYS_keyctl, KEYCTL_JOIN, NULL) >= 0
           && syscall(SYS_keyctl, KEYCTL_SETPERM, KEYRING_SESSION, SEALED) == 0;
}

/* -s, in the loop before each clone: a detached tmpfs with a tmp folder, as tmpfs.make. */
static int make_home(void) {
    int fs = (int)syscall(NR_FSOPEN, "tmpfs", 1 /* FSOPEN_CLOEXEC */);
    if (fs < 0) die("fsopen");
    char owner[16];
    snprintf(owner, sizeof owner, "%d", (int)uid);
    const char *options[][2] = {{"size", "16m"}, {"nr_inodes", "4096"}, {"mode", "0700"},
                                {"uid", owner}, {"gid", owner}};
    for (size_t i = 0; i < sizeof options / sizeof *options; i++)
        if (syscall(NR_FSCONFIG, fs, HOME_FSCONFIG_SET_STRING, options[i][0], options[i][1], 0) < 0)
            die("fsconfig");
    if (syscall(NR_FSCONFIG, fs, HOME_FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0) die("fsconfig");
    int mount_fd = (int)syscall(NR_FSMOUNT, fs, 1 /* FSMOUNT_CLOEXEC */,
                                HOME_MOUNT_ATTR_NOSUID | HOME_MOUNT_ATTR_NODEV);
    if (mount_fd < 0) die("fsmount");
    close(fs);
    if (mkdirat(mount_fd, "tmp", 0700) < 0 || fchownat(mount_fd, "tmp", uid, uid, AT_SYMLINK_NOFOLLOW) < 0)
        die("the home's tmp");
    return mount_fd;
}

/* -s, in the child as root: the mounts, the IPC namespace, the persistent keyring. */
static void sandbox_as_root(const char *program, int mount_fd) {
    if (syscall(NR_MOVE_MOUNT, mount_fd, "", AT_FDCWD, home, HOME_MOVE_MOUNT_F_EMPTY_PATH) < 0)
        _exit(127);
    if (mount(program, placeholder, NULL, MS_BIND, NULL) < 0) _exit(128);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s/tmp", home);
    for (int i = 0; i < ntargets; i++)
        if (mount(tmp, targets[i], NULL, MS_BIND, NULL) < 0 && errno != ENOENT && errno != ENOTDIR)
            _exit(129);
    if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m") < 0)
        _exit(130);
    if (unshare(CLONE_NEWIPC) < 0) _exit(131);
    if (keyrings) {
        long persistent = syscall(SYS_keyctl, KEYCTL_PERSISTENT, (long)uid, KEYRING_SESSION);
        if (persistent < 0 && !nothing_there()) _exit(132);
        if (persistent >= 0) {
            if (syscall(SYS_keyctl, KEYCTL_EMPTY, persistent) < 0 && !nothing_there()) _exit(132);
            if (syscall(SYS_keyctl, KEYCTL_UNLINK, persistent, KEYRING_SESSION) < 0) _exit(132);
        }
    }
}

/* In the child: isolate, drop to the uid, exec. Never returns. */
static void become(char **argv, char **envp, int null, int mount_fd) {
    if (sandbox && setpgid(0, 0) < 0) _exit(126);
    if (as_root) {
        if (unshare(CLONE_NEWNS) < 0) _exit(120);
        if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) _exit(121);
        if (sandbox) sandbox_as_root(argv[0], mount_fd);
        else if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=16m") < 0)
            _exit(122);
    }
    struct rlimit no_core = {0, 0};
    if (sandbox && setrlimit(RLIMIT_CORE, &no_core) < 0) _exit(133);
    if (as_root) {
        if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0)
            _exit(123);
        if (keyrings && ((syscall(SYS_keyctl, KEYCTL_EMPTY, KEYRING_USER) < 0 && !nothing_there())
                         || (syscall(SYS_keyctl, KEYCTL_EMPTY, KEYRING_USER_SESSION) < 0
                             && !nothing_there())))
            _exit(134);
    }
    if (sandbox) {
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) _exit(135);
        umask(077);
        if (as_root && chdir(home) < 0) _exit(136);
    }
    if (dup2(null, 0) < 0 || dup2(null, 1) < 0) _exit(124);
    if (sandbox) {
        if (syscall(SYS_close_range, 3, ~0U, 0) < 0)
            for (int fd = 3; fd < 65536; fd++) close(fd);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
    }
    execve(sandbox && as_root ? placeholder : argv[0], argv, envp);
    _exit(125);
}

struct child { char **argv, **envp; int null, mount_fd; };

static int child_main(void *arg) {
    struct child *c = arg;
    become(c->argv, c->envp, c->null, c->mount_fd);
    return 125;
}

/* the child's stack until its exec (each -j loop is a process with its own copy) */
static char child_stack[64 * 1024] __attribute__((aligned(16)));

/* n spawns one after another; each one's wall time into walls (when not NULL), the
 * children's CPU added to *child_us. */
static void loop(int n, char **argv, char **envp, int null, long long *walls, long long *child_us,
                 int forked) {
    /* a forked loop seals a keyring of its own; the first was sealed by main */
    if (keyrings && forked && !seal_keyring()) die("the sealed session keyring");
    for (int i = 0; i < n; i++) {
        long long began = now_us();
        struct child c = {argv, envp, null, sandbox && as_root ? make_home() : -1};
        pid_t pid = clone(child_main, child_stack + sizeof child_stack,
                          CLONE_VM | CLONE_VFORK | SIGCHLD, &c);
        if (pid < 0) die("clone");
        int status;
        struct rusage usage;
        if (wait4(pid, &status, 0, &usage) < 0) die("wait4");
        if (c.mount_fd >= 0) close(c.mount_fd);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "floor: the program ended with status %#x\n", status);
            exit(3);
        }
        *child_us += (long long)(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1000000
                     + usage.ru_utime.tv_usec + usage.ru_stime.tv_usec;
        if (walls) walls[i] = now_us() - began;
    }
}

int main(int argc, char **argv) {
    int n = 100, jobs = 1, opt;
    while ((opt = getopt(argc, argv, "n:j:u:c:s:t:")) != -1) {
        switch (opt) {
        case 'n': n = atoi(optarg); break;
        case 'j': jobs = atoi(optarg); break;
        case 'u': uid = (uid_t)atoi(optarg); break;
        case 'c':
            if (nprocs == MAX_CGROUPS) return 2;
            procs[nprocs++] = optarg;
            break;
        case 's': sandbox = optarg; break;
        case 't':
            if (ntargets == MAX_CGROUPS) return 2;
            targets[ntargets++] = optarg;
            break;
        default: return 2;
        }
    }
    if (optind >= argc || n < 1 || jobs < 1 || jobs > n) {
        fprintf(stderr, "usage: floor [-n N] [-j J] [-u UID] [-c PROCS]... [-s DIR [-t TARGET]...] -- PROGRAM [ARG]...\n");
        return 2;
    }
    as_root = geteuid() == 0;
    char *envp[] = {"PATH=/usr/bin:/bin", NULL};
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0) die("/dev/null");
    long long *walls = jobs == 1 ? calloc((size_t)n, sizeof *walls) : NULL;
    if (as_root && nprocs) join_slot();
    if (sandbox) {
        snprintf(home, sizeof home, "%s/home", sandbox);
        snprintf(placeholder, sizeof placeholder, "%s/program", sandbox);
    }
    /* Whether keyctl answers here: this process's sealed keyring, the one loop's, or
     * (-j) each forked loop seals one of its own. */
    keyrings = as_root && sandbox && seal_keyring();
    /* the children's CPU, a counter per loop, shared with the loops' processes */
    long long *child_us = mmap(NULL, (size_t)jobs * sizeof *child_us, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (child_us == MAP_FAILED) die("mmap");

    long long cpu0 = cpu_us(RUSAGE_SELF) + cpu_us(RUSAGE_CHILDREN), began = now_us();
    if (jobs == 1) {
        loop(n, argv + optind, envp, null, walls, child_us, 0);
    } else {
        for (int j = 0; j < jobs; j++) {
            pid_t pid = fork();
            if (pid < 0) die("fork");
            if (pid == 0) {
                loop(n / jobs + (j < n % jobs), argv + optind, envp, null, NULL, child_us + j, 1);
                _exit(0);
            }
        }
        int status;
        while (wait(&status) > 0)
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 3;
    }
    long long wall = now_us() - began;
    long long cpu = cpu_us(RUSAGE_SELF) + cpu_us(RUSAGE_CHILDREN) - cpu0, children = 0;
    for (int j = 0; j < jobs; j++) children += child_us[j];

    printf("spawns=%d\njobs=%d\ncpu_us=%lld\nchild_cpu_us=%lld\nwall_us=%lld\nskipped=", n,
           jobs, cpu, children, wall);
    const char *sep = "";
    if (!as_root) {
        printf("mount namespace and /tmp tmpfs (not root); uid (not root)");
        sep = "; ";
        if (sandbox) printf("; the sandbox's tmpfs home, mounts, IPC namespace and keyrings (not root)");
    }
    if (!as_root || !nprocs) {
        printf("%scgroup slot (%s)", sep, as_root ? "no cgroup v1" : "not root");
        sep = "; ";
    }
    if (as_root && sandbox && !keyrings) printf("%skeyrings (keyctl refused)", sep);
    printf("\n");
    if (walls) {
        printf("walls_us=");
        for (int i = 0; i < n; i++) printf(i ? ",%lld" : "%lld", walls[i]);
        printf("\n");
    }
    return 0;
}
