// Starts Swagger UI (its bundle is loaded before this file) on the service's OpenAPI
// document. A file, not an inline script, so the page's policy can refuse every inline
// script. validatorUrl null: Swagger UI would otherwise send the document to a third
// party's validator. The token typed into "Authorize" is kept for the page only.
"use strict";
(function () {
  const holder = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: holder.dataset.openapi,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null,
    persistAuthorization: false,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
})();
