"""An nginx configuration equivalent to the generated HAProxy front door, for measuring (issue 26).

Routes `/v1/stream/<name>` to the member that owns it by the same arithmetic as HAProxy's
`path,crc32,mod(4096),map(slots.map)`: the path as sent (query excluded), CRC-32 (nginx's
`ngx.crc32_long` is zlib's), mod 4096, looked up in a table of the placement's slot owners. nginx
has no CRC-32 of a variable of its own, so the lookup needs the Lua module (Debian:
`libnginx-mod-http-lua`). With `static_paths` the lookup is instead a `map` of the exact paths
given (what a benchmark sends): no Lua, but useless for any other stream, so only a measure of
what the Lua lookup costs. Everything else goes to the first member, as HAProxy's
`default_backend`. Members are reached over HTTP/1.1 keep-alive (an upstream `keepalive` pool per
member); responses and request bodies are not buffered, so live reads flow as they are written.
The headers HAProxy sets for the members are set the same (epoch, client HTTP version, scheme,
X-Forwarded-For). Not equivalent: no per-member `maxconn` queue (nginx's `queue` is commercial),
no health checks, and HTTP/1.1 only on the port (nginx 1.22 cannot serve h2c and HTTP/1.1 on one
clear-text port).
"""

from __future__ import annotations

from pathlib import Path

from streamkeep.cluster.haproxy import backend
from streamkeep.cluster.placement import SLOTS, Placement, slot
from streamkeep.protocol.names import STREAM_PREFIX

MODULES = Path("/usr/lib/nginx/modules")


def config(
    placement: Placement,
    *,
    prefix: Path,
    port: int,
    bind: str = "127.0.0.1",
    workers: int = 1,
    keepalive: int = 32,
    live_seconds: float = 60.0,
    static_paths: list[str] | None = None,
) -> str:
    """nginx.conf text; `prefix` holds its pid file, error log and temporary files."""
    quiet = int(live_seconds) + 30
    owner_of = [backend(placement.owner_of_slot(number).id) for number in range(SLOTS)]
    lines = [
        f"# Equivalent of the generated HAProxy front door (epoch {placement.epoch}); for measuring.",
        f"worker_processes {workers};",
        "daemon off;",
        f"pid {prefix / 'nginx.pid'};",
        f"error_log {prefix / 'error.log'} warn;",
    ]
    if static_paths is None:
        lines += [
            f"load_module {MODULES / 'ndk_http_module.so'};",
            f"load_module {MODULES / 'ngx_http_lua_module.so'};",
        ]
    lines += [
        "events { worker_connections 8000; }",
        "http {",
        "    access_log off;",
        f"    client_body_temp_path {prefix / 'body'};",
        f"    proxy_temp_path {prefix / 'proxy'};",
        f"    fastcgi_temp_path {prefix / 'fastcgi'};",
        f"    uwsgi_temp_path {prefix / 'uwsgi'};",
        f"    scgi_temp_path {prefix / 'scgi'};",
        "    keepalive_requests 1000000;",
        "    keepalive_timeout 75s;",
        "    client_max_body_size 0;",
        "    tcp_nodelay on;",
        '    map $server_protocol $client_version { "HTTP/1.1" "1.1"; "HTTP/2.0" "2.0"; '
        '"HTTP/1.0" "1.0"; default "other"; }',
    ]
    for member in placement.members:
        lines += [
            f"    upstream {backend(member.id)} {{",
            f"        server {member.address};",
            f"        keepalive {keepalive};",
            "        keepalive_requests 1000000;",
            "        keepalive_timeout 75s;",
            "    }",
        ]
    if static_paths is None:
        table = ", ".join(f'"{name}"' for name in owner_of)
        lines += [f"    init_by_lua_block {{ slots = {{{table}}} }}"]
        # The path as sent, query excluded: HAProxy's `path` (nginx's $uri is decoded and normalised).
        route = [
            "            set_by_lua_block $member {",
            "                local path = ngx.var.request_uri",
            '                local query = path:find("?", 1, true)',
            "                if query then path = path:sub(1, query - 1) end",
            f"                return slots[ngx.crc32_long(path) % {SLOTS} + 1]",
            "            }",
        ]
    else:
        default = backend(placement.members[0].id)
        lines += ["    map $uri $member {", f"        default {default};"]
        lines += [f"        {path} {owner_of[slot(path)]};" for path in static_paths]
        lines += ["    }"]
        route = []
    proxy = [
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        "            proxy_set_header Host $http_host;",
        f"            proxy_set_header Streamkeep-Placement-Epoch {placement.epoch};",
        "            proxy_set_header Streamkeep-Client-Http-Version $client_version;",
        "            proxy_set_header Streamkeep-Client-Scheme $scheme;",
        "            proxy_set_header X-Forwarded-For $remote_addr;",
        "            proxy_buffering off;",
        "            proxy_request_buffering off;",
        f"            proxy_read_timeout {quiet}s;",
        f"            proxy_send_timeout {quiet}s;",
    ]
    lines += [
        "    server {",
        f"        listen {bind}:{port} reuseport;",
        f"        location {STREAM_PREFIX} {{",
        *route,
        "            proxy_pass http://$member;",
        *proxy,
        "        }",
        "        location / {",
        f"            proxy_pass http://{backend(placement.members[0].id)};",
        *proxy,
        "        }",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)
