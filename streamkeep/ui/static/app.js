// The shell: the token field, the notice line, and a hash router that shows one page at a time.
// A page is a module exporting `render(main)`, which builds its DOM under `main` and returns a
// function that stops its timers and requests when the page is left.
//
//   #/               the stream list (streams.js)
//   #/stream/<name>  one stream (stream.js); the name percent-encoded as one piece

import { setToken, token } from "./api.js";
import * as streamsPage from "./streams.js";
import * as streamPage from "./stream.js";

const main = document.getElementById("app");
const tokenInput = document.getElementById("token");
const tokenState = document.getElementById("token-state");
let leave = () => {};

function route() {
  leave();
  main.replaceChildren();
  const hash = location.hash.replace(/^#/, "") || "/";
  if (hash.startsWith("/stream/")) {
    const name = decodeURIComponent(hash.slice("/stream/".length));
    document.title = `${name} · streamkeep`;
    leave = streamPage.render(main, name);
  } else {
    document.title = "streams · streamkeep";
    leave = streamsPage.render(main);
  }
}

function showTokenState() {
  tokenState.textContent = token() ? "token set (this tab only)" : "no token";
  tokenInput.value = "";
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault(); // never a real submit: the token must not land in a URL
  setToken(tokenInput.value.trim());
  showTokenState();
  route();
});

document.getElementById("token-clear").addEventListener("click", () => {
  setToken("");
  showTokenState();
  route();
});

window.addEventListener("hashchange", route);
showTokenState();
route();
