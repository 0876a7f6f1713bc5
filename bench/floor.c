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
 * -s adds the parts of the sandbox Cairn's helper gives every attempt (spawn.c, become)
 * that the bare spawn has not, so that the attempts' own processes can be put beside the
 * same sandbox with none of Cairn's bookkeeping: a process group of its own; a tmpfs home
 * (made in the child here, where Cairn's helper makes it before the clone), the program
 * bound onto itself, /tmp bound onto /var/tmp and a fresh tmpfs on /dev/shm; an IPC
 * namespace; RLIMIT_CORE 0; the uid's persistent keyring emptied as root through this
 * process's sealed session keyring (made at its start, as the helper's) and its user and
 * user-session keyrings as the uid; no_new_privs, umask 077, the home as the working
 * folder, descriptors from 3 closed and the signal mask cleared.
 *
 * Prints key=value lines: spawns, cpu_us (its own and its reaped descendants' rusage,
 * user + system, over the loops), wall_us (the loops' elapsed time), skipped, and with
 * -j 1 walls_us (each spawn's clone-to-reaped time, comma-separated).
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
static int sandbox, keyrings; /* -s; its keyrings' part (keyctl answered) */

#define KEYCTL_JOIN 1
#define KEYCTL_SETPERM 5
#define KEYCTL_EMPTY 7
#define KEYCTL_UNLINK 9
#define KEYCTL_PERSISTENT 22
#define KEYRING_SESSION (-3)
#define KEYRING_USER (-4)
#define KEYRING_USER_SESSION (-5)
/* possessor view; owner (root) view, read, write, search, link: as spawn.c's SEALED */
#define SEALED 0x011f0000

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

/* -s, in the child before the uid is dropped: the rest of Cairn's sandbox. */
static void sandbox_as_root(const char *program) {
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=16m") < 0)
        _exit(126);
    if (mkdir("/tmp/home", 0700) < 0 || mount("tmpfs", "/tmp/home", "tmpfs", MS_NOSUID | MS_NODEV,
                                              "mode=0700,size=16m") < 0
        || chown("/tmp/home", uid, uid) < 0)
        _exit(126);
    if (mount(program, program, NULL, MS_BIND, NULL) < 0) _exit(126);
    if (mount("/tmp", "/var/tmp", NULL, MS_BIND, NULL) < 0) _exit(126);
    if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m") < 0)
        _exit(126);
    if (unshare(CLONE_NEWIPC) < 0) _exit(127);
    struct rlimit none = {0, 0};
    if (setrlimit(RLIMIT_CORE, &none) < 0) _exit(127);
    long persistent =
        keyrings ? syscall(SYS_keyctl, KEYCTL_PERSISTENT, (long)uid, KEYRING_SESSION) : -1;
    if (persistent >= 0) {
        syscall(SYS_keyctl, KEYCTL_EMPTY, persistent);
        syscall(SYS_keyctl, KEYCTL_UNLINK, persistent, KEYRING_SESSION);
    }
}

/* In the child: isolate, drop to the uid, exec. Never returns. */
static void become(char **argv, char **envp, int null) {
    if (sandbox && setpgid(0, 0) < 0) _exit(126);
    if (as_root) {
        if (unshare(CLONE_NEWNS) < 0) _exit(120);
        if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) _exit(121);
        if (sandbox) sandbox_as_root(argv[0]);
        else if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=16m") < 0)
            _exit(122);
        if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0)
            _exit(123);
        if (keyrings) {
            syscall(SYS_keyctl, KEYCTL_EMPTY, KEYRING_USER);
            syscall(SYS_keyctl, KEYCTL_EMPTY, KEYRING_USER_SESSION);
        }
    }
    if (sandbox) {
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) _exit(127);
        umask(077);
        if (as_root && chdir("/tmp/home") < 0) _exit(127);
    }
    if (dup2(null, 0) < 0 || dup2(null, 1) < 0) _exit(124);
    if (sandbox) {
        syscall(SYS_close_range, 3, ~0U, 0);
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
    }
    execve(argv[0], argv, envp);
    _exit(125);
}

struct child { char **argv, **envp; int null; };

static int child_main(void *arg) {
    struct child *c = arg;
    become(c->argv, c->envp, c->null);
    return 125;
}

/* the child's stack until its exec (each -j loop is a process with its own copy) */
static char child_stack[64 * 1024] __attribute__((aligned(16)));

/* n spawns one after another; each one's wall time into walls (when not NULL). */
static void loop(int n, char **argv, char **envp, int null, long long *walls) {
    for (int i = 0; i < n; i++) {
        long long began = now_us();
        struct child c = {argv, envp, null};
        pid_t pid = clone(child_main, child_stack + sizeof child_stack,
                          CLONE_VM | CLONE_VFORK | SIGCHLD, &c);
        if (pid < 0) die("clone");
        int status;
        struct rusage usage;
        if (wait4(pid, &status, 0, &usage) < 0) die("wait4");
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "floor: the program ended with status %#x\n", status);
            exit(3);
        }
        if (walls) walls[i] = now_us() - began;
    }
}

int main(int argc, char **argv) {
    int n = 100, jobs = 1, opt;
    while ((opt = getopt(argc, argv, "n:j:u:c:s")) != -1) {
        switch (opt) {
        case 'n': n = atoi(optarg); break;
        case 'j': jobs = atoi(optarg); break;
        case 'u': uid = (uid_t)atoi(optarg); break;
        case 'c':
            if (nprocs == MAX_CGROUPS) return 2;
            procs[nprocs++] = optarg;
            break;
        case 's': sandbox = 1; break;
        default: return 2;
        }
    }
    if (optind >= argc || n < 1 || jobs < 1 || jobs > n) {
        fprintf(stderr, "usage: floor [-n N] [-j J] [-u UID] [-c PROCS]... [-s] -- PROGRAM [ARG]...\n");
        return 2;
    }
    as_root = geteuid() == 0;
    char *envp[] = {"PATH=/usr/bin:/bin", NULL};
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0) die("/dev/null");
    long long *walls = jobs == 1 ? calloc((size_t)n, sizeof *walls) : NULL;
    if (as_root && nprocs) join_slot();
    keyrings = as_root && sandbox && syscall(SYS_keyctl, KEYCTL_JOIN, NULL) >= 0
               && syscall(SYS_keyctl, KEYCTL_SETPERM, KEYRING_SESSION, SEALED) == 0;

    long long cpu0 = cpu_us(RUSAGE_SELF) + cpu_us(RUSAGE_CHILDREN), began = now_us();
    if (jobs == 1) {
        loop(n, argv + optind, envp, null, walls);
    } else {
        for (int j = 0; j < jobs; j++) {
            pid_t pid = fork();
            if (pid < 0) die("fork");
            if (pid == 0) {
                loop(n / jobs + (j < n % jobs), argv + optind, envp, null, NULL);
                _exit(0);
            }
        }
        int status;
        while (wait(&status) > 0)
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 3;
    }
    long long wall = now_us() - began;
    long long cpu = cpu_us(RUSAGE_SELF) + cpu_us(RUSAGE_CHILDREN) - cpu0;

    printf("spawns=%d\njobs=%d\ncpu_us=%lld\nwall_us=%lld\nskipped=", n, jobs, cpu, wall);
    const char *sep = "";
    if (!as_root) {
        printf("mount namespace and /tmp tmpfs (not root); uid (not root)");
        sep = "; ";
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
