#include "hostport.h"

#include <stdlib.h>
#include <string.h>

bool moe_hostport_split(const char *s, char *host, size_t cap, int *port)
{
    const char *colon = s ? strrchr(s, ':') : NULL;
    if (!colon || !colon[1])
        return false;
    size_t hl = (size_t)(colon - s);
    const char *h = s;
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    if (hl >= cap)
        return false;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 0 || p > 65535)
        return false;
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (int)p;
    return true;
}

int moe_hostport_host_len(const char *s)
{
    const char *colon = strrchr(s, ':');
    return colon ? (int)(colon - s) : (int)strlen(s);
}
