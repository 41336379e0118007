/* common/cli: the flag table every program's parser goes through
 * (cli_take), the number parsers, and HOST:PORT values. A refusal is
 * cli_fail's exit code 2 (its line on stderr is expected). */
#include <limits.h>
#include <stdbool.h>
#include <string.h>

#include "cli.h"
#include "testlib.h"

struct vals {
    bool sw;
    const char *str;
    int num;
};

/* Runs cli_take over argv (NULL-terminated) from index 1; returns its
 * result and leaves the index in *at. */
static int take(struct vals *v, const struct cli_opt **other, const char **value, int *at,
                char **argv)
{
    const struct cli_opt opts[] = {
        {"--sw", CLI_SWITCH, &v->sw, 0, 0},
        {"--str", CLI_STR, &v->str, 0, 0},
        {"--num", CLI_INT, &v->num, -5, 100},
        {"--other", CLI_OTHER, NULL, 0, 0},
    };
    int argc = 0;
    while (argv[argc])
        argc++;
    *at = 1;
    return cli_take(opts, sizeof opts / sizeof opts[0], argc, argv, at, other, value);
}

int main(void)
{
    cli_init("test_cli");
    struct vals v = {0};
    const struct cli_opt *o;
    const char *val;
    int at;

    char *a1[] = {"prog", "--sw", "--num", NULL};
    CHECK(take(&v, &o, &val, &at, a1) == 0 && v.sw && at == 1 && !o && !val);
    char *a2[] = {"prog", "--str", "x y", NULL};
    CHECK(take(&v, &o, &val, &at, a2) == 0 && v.str && !strcmp(v.str, "x y") && at == 2);
    char *a3[] = {"prog", "--num", "-5", NULL};
    CHECK(take(&v, &o, &val, &at, a3) == 0 && v.num == -5 && at == 2);
    char *a4[] = {"prog", "--num", "100", NULL};
    CHECK(take(&v, &o, &val, &at, a4) == 0 && v.num == 100);
    /* out of range, not a number, trailing text, missing: refused, unchanged */
    char *a5[] = {"prog", "--num", "101", NULL};
    CHECK(take(&v, &o, &val, &at, a5) == 2 && v.num == 100);
    char *a6[] = {"prog", "--num", "12abc", NULL};
    CHECK(take(&v, &o, &val, &at, a6) == 2 && v.num == 100);
    char *a7[] = {"prog", "--num", NULL};
    CHECK(take(&v, &o, &val, &at, a7) == 2 && v.num == 100);
    char *a8[] = {"prog", "--str", NULL};
    CHECK(take(&v, &o, &val, &at, a8) == 2);
    /* CLI_OTHER: the flag and its value handed back, nothing stored */
    char *a9[] = {"prog", "--other", "7", NULL};
    CHECK(take(&v, &o, &val, &at, a9) == 0 && o && !strcmp(o->name, "--other") && val &&
          !strcmp(val, "7") && at == 2);
    /* not one of them (nor a prefix of one): 1, the index unchanged */
    char *a10[] = {"prog", "--nu", "3", NULL};
    CHECK(take(&v, &o, &val, &at, a10) == 1 && at == 1 && !o);
    char *a11[] = {"prog", "--sw=1", NULL};
    CHECK(take(&v, &o, &val, &at, a11) == 1);

    long n;
    CHECK(cli_parse_long("0", 0, 0, &n) && n == 0);
    CHECK(!cli_parse_long("", 0, 10, &n) && !cli_parse_long(" 1", 0, 10, &n) &&
          !cli_parse_long("1 ", 0, 10, &n) &&
          !cli_parse_long("99999999999999999999", 0, LONG_MAX, &n));
    float f;
    CHECK(cli_parse_float("0.5", 0.0f, 1.0f, &f) && f == 0.5f);
    CHECK(!cli_parse_float(" 0.5", 0.0f, 1.0f, &f) && !cli_parse_float("0.5x", 0.0f, 1.0f, &f));
    CHECK(!cli_parse_float("nan", 0.0f, 1.0f, &f) && !cli_parse_float("1.5", 0.0f, 1.0f, &f) &&
          !cli_parse_float("1e309", 0.0f, 1e30f, &f));

    CHECK(cli_check_hostport("--listen", NULL) == 0);
    CHECK(cli_check_hostport("--listen", "127.0.0.1:0") == 0);
    CHECK(cli_check_hostport("--listen", "[::1]:65535") == 0);
    CHECK(cli_check_hostport("--listen", "fd00::1:50061") == 0); /* split at the last ':' */
    CHECK(cli_check_hostport("--listen", "127.0.0.1:65536") == 2);
    CHECK(cli_check_hostport("--listen", "127.0.0.1") == 2);
    CHECK(cli_check_hostport("--listen", "127.0.0.1:") == 2);
    CHECK(cli_check_hostport("--listen", "h:-1") == 2);
    return test_summary();
}
